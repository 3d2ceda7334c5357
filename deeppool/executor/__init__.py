"""The executor: run a Plan on torch.distributed, exactly like single-process training.

``deeppool run plan.json --nproc N`` launches the ranks (torchrun underneath);
``torchrun ... -m deeppool.executor plan.json [config.json]`` runs one rank per process on
any number of machines; :func:`train_rank` is the Python API (a user data
loader, an idle-window listener, injected communication). See
``docs/executor.md``.

Its rooms, imports going one way from the top down: ``launch`` (the launcher, the
worker process, the commands) over ``api`` over ``training`` (checkpoints, the
``--check`` reference, step figures, adaptation, the summary) over ``engine`` (one
rank's iteration), all over ``config``.
"""

import importlib
from typing import Any

_HOMES = {
    "ModelBuilder": "api", "RankResult": "api", "train_rank": "api",
    "Backend": "config", "OptimizerConfig": "config", "RunConfig": "config",
    "Adaptation": "config", "LrScaling": "config", "Monitor": "config",
    "GnsReading": "engine.monitor", "GradientMonitor": "engine.monitor",
    "Comm": "engine.comm", "TorchComm": "engine.comm",
    "IdleListener": "engine.idle", "IdleWindowEvent": "engine.idle",
    "RunSummary": "training.summary",
}
"""Where each public name lives: imported on first use, so ``deeppool --help`` never loads torch."""

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'deeppool.executor' has no attribute '{name}'")
    return getattr(importlib.import_module(f"deeppool.executor.{_HOMES[name]}"), name)
