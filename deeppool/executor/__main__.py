"""``python -m deeppool.executor plan.json [options]``: one rank, for torchrun."""

from deeppool.executor.cli import worker_app

worker_app(prog_name="python -m deeppool.executor")
