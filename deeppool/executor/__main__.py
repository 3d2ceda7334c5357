"""``python -m deeppool.executor plan.json [config.json]``: one rank, for torchrun (its settings: the config file
``deeppool run`` writes into its ``--out``; without one, ``deeppool run``'s defaults).

The program, not a module of the executor's layer: it starts the worker of the command layer above
(:mod:`deeppool.run_command`), which wires the multiplexer into the executor.
"""

import os
import signal

if "TORCHELASTIC_RUN_ID" in os.environ:  # deeppool.interrupt.AGENT_ENV, read before that module's imports load
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # an interrupt while the imports below load ends the rank silently

from deeppool.interrupt import AGENT_ENV, quiet_rank  # noqa: E402

if AGENT_ENV in os.environ:
    quiet_rank()

from deeppool.run_command import worker_app  # noqa: E402

worker_app(prog_name="python -m deeppool.executor")
