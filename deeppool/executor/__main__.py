"""``python -m deeppool.executor plan.json [options]``: one rank, for torchrun."""

import os

from deeppool.interrupt import AGENT_ENV, quiet_rank

if AGENT_ENV in os.environ:
    quiet_rank()  # before the imports below: an interrupt while they load is silent too

from deeppool.executor.cli import worker_app  # noqa: E402

worker_app(prog_name="python -m deeppool.executor")
