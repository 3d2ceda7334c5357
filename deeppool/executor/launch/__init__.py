"""Launching processes: ``deeppool run``'s launcher, one rank's worker, and the executor's commands.

The ranks' command-line options, the elastic agent and the hung-rank watch, the worker process that
calls :func:`deeppool.executor.api.train_rank`, the run report, and the network probe. The top of the
executor: it may import everything below it (:mod:`deeppool.executor.api`, ``training``, ``engine``).
"""
