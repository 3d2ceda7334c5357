"""The engine: one rank's training iteration, and what it is built from.

A rank's :class:`~deeppool.executor.engine.program.Program` (its stages and ops), the stage modules and
the layers the rank holds, communication (:class:`~deeppool.executor.engine.comm.Comm`), the bucketed
gradient all-reduce and its overlap with the backward, synchronised BatchNorm, mixed precision, the
rows of a batch a rank loads, the gradient-noise monitor, timing spans, idle windows and injected faults.
Of the rest of the executor it imports only the run's configuration (:mod:`deeppool.executor.config`).
"""
