"""The executor: run a Plan on torch.distributed, exactly like single-process training.

``deeppool run plan.json --nproc N`` launches the ranks (torchrun underneath);
``torchrun ... -m deeppool.executor plan.json`` runs one rank per process on
any number of machines; :func:`train_rank` is the Python API (a user data
loader, an idle-window listener, injected communication). See
``docs/executor.md``.
"""

from deeppool.executor.api import ModelBuilder, RankResult, train_rank
from deeppool.executor.comm import Backend, Comm, TorchComm
from deeppool.executor.config import OptimizerConfig, OptimizerKind, RunConfig
from deeppool.executor.idle import IdleListener, IdleWindowEvent
from deeppool.executor.summary import RunSummary

__all__ = [
    "Backend", "Comm", "IdleListener", "IdleWindowEvent", "ModelBuilder", "OptimizerConfig", "OptimizerKind",
    "RankResult", "RunConfig", "RunSummary", "TorchComm", "train_rank",
]
