"""Typed configuration of a run (validated at construction)."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from deeppool.errors import DeeppoolError

if TYPE_CHECKING:  # torch loads when an optimizer is built: the CLI checks options without it
    import torch


class Backend(enum.Enum):
    AUTO = "auto"
    GLOO = "gloo"
    NCCL = "nccl"

    def resolve(self, cuda_available: bool) -> Backend:
        """AUTO is NCCL when CUDA is available, else gloo."""
        if self is not Backend.AUTO:
            return self
        return Backend.NCCL if cuda_available else Backend.GLOO


DEFAULT_TIMEOUT_S = 60.0
"""Seconds before a stalled communication fails: a hung rank is named about this long after it stops."""


class OptimizerKind(enum.Enum):
    SGD = "sgd"
    ADAM = "adam"


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    kind: OptimizerKind = OptimizerKind.SGD
    lr: float = 0.01
    momentum: float = 0.0

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise DeeppoolError(f"--lr {self.lr} must be positive")
        if not 0 <= self.momentum < 1:
            raise DeeppoolError(f"--momentum {self.momentum} must be in [0, 1)")

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        import torch

        params = list(params)
        if self.kind is OptimizerKind.ADAM:
            return torch.optim.Adam(params, lr=self.lr)
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)


class BatchNormMode(enum.Enum):
    """Whose statistics a BatchNorm layer on several ranks normalises with."""

    SYNC = "sync"
    """The layer's whole batch, summed over its ranks (:mod:`deeppool.executor.syncbn`): exact to
    single-process training, at three small blocking all-reduces per BatchNorm per iteration."""
    LOCAL = "local"
    """Each rank's own samples, as ``DistributedDataParallel`` with ``nn.BatchNorm`` computes: no
    communication, but not single-process training (the statistics depend on the split)."""


class ScheduleKind(enum.Enum):
    CONSTANT = "constant"
    LINEAR = "linear"
    COSINE = "cosine"


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """The learning rate's factor by optimizer step: linear warm-up over ``warmup_steps``, then
    constant, or decaying to 0 at ``total_steps`` (linearly or along a half cosine)."""

    kind: ScheduleKind = ScheduleKind.CONSTANT
    warmup_steps: int = 0
    total_steps: int = 1

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise DeeppoolError(f"--lr-warmup {self.warmup_steps} must be >= 0")
        if self.total_steps < 1:
            raise DeeppoolError(f"the schedule's total steps {self.total_steps} must be at least 1")

    def factor(self, step: int) -> float:
        """The multiplier of ``--lr`` at optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind is ScheduleKind.CONSTANT:
            return 1.0
        span = max(1, self.total_steps - self.warmup_steps)
        done = min(1.0, (step - self.warmup_steps) / span)
        if self.kind is ScheduleKind.LINEAR:
            return 1.0 - done
        return 0.5 * (1.0 + math.cos(math.pi * done))

    def build(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        import torch

        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.factor)


@dataclass(frozen=True, kw_only=True)
class Training:
    """What one optimizer step does beyond the plan: micro-batches, clipping, the LR schedule."""

    accumulate: int = 1
    """Global batches (of ``plan.global_batch`` samples) whose gradients are summed per optimizer step."""
    clip_norm: float | None = None
    """Scale gradients so their global L2 norm (over every parameter of the model) is at most this."""
    schedule: Schedule = field(default_factory=Schedule)

    def __post_init__(self) -> None:
        if self.accumulate < 1:
            raise DeeppoolError(f"--accumulate {self.accumulate} must be at least 1")
        if self.clip_norm is not None and self.clip_norm <= 0:
            raise DeeppoolError(f"--clip-norm {self.clip_norm} must be positive")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where checkpoints go (:mod:`deeppool.executor.checkpoint`), how often, and whether to resume."""

    directory: Path
    every: int = 0
    """Write after every ``every`` optimizer steps (0: never)."""
    resume: bool = False
    """Start from the latest complete checkpoint in ``directory``."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise DeeppoolError(f"--checkpoint-every {self.every} must be >= 0")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """How to run a plan: steps, optimizer, backend, timeouts, checking, outputs."""

    steps: int = 50
    warmup: int = 5
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    backend: Backend = Backend.AUTO
    timeout_s: float = DEFAULT_TIMEOUT_S
    bucket_mb: float = 25.0
    check: bool = False
    check_bound: float = 1e-3
    out_dir: Path | None = None
    training: Training = field(default_factory=Training)
    checkpoint: CheckpointConfig | None = None
    batchnorm: BatchNormMode = BatchNormMode.SYNC

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise DeeppoolError(f"--steps {self.steps} must be at least 1")
        if self.warmup < 0:
            raise DeeppoolError(f"--warmup {self.warmup} must be >= 0")
        if self.timeout_s <= 0:
            raise DeeppoolError(f"--timeout {self.timeout_s} must be positive")
        if self.bucket_mb < 0:
            raise DeeppoolError(f"--bucket-mb {self.bucket_mb} must be >= 0")
        if self.check_bound <= 0:
            raise DeeppoolError(f"--check-bound {self.check_bound} must be positive")
        if self.check and self.checkpoint is not None and self.checkpoint.resume:
            raise DeeppoolError("--check trains its reference from the start: run --resume without --check")
        if self.check and self.batchnorm is BatchNormMode.LOCAL:
            raise DeeppoolError("--check compares with single-process training, whose BatchNorm uses the whole "
                                "batch's statistics: run --check with --batchnorm sync")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)


DEFAULT_SIZES = (4 * 2**10, 64 * 2**10, 2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20)
"""Message sizes in bytes: 4 KiB to 64 MiB (a reshard of a few samples to a large gradient bucket)."""


@dataclass(frozen=True, kw_only=True)
class Nodes:
    """Where a run's ranks are: this machine alone, or ``count`` machines meeting at a rendezvous.

    As torchrun's ``--nnodes N --rdzv-endpoint HOST:PORT --rdzv-id ID``: the same command runs on every
    machine, each starts ``--nproc`` ranks, and the rendezvous gives them their global ranks. The first
    machine to reach ``HOST:PORT`` (the one whose address it is) hosts the rendezvous store.
    """

    count: int = 1
    endpoint: str | None = None
    run_id: str | None = None

    def __post_init__(self) -> None:
        if self.count < 1:
            raise DeeppoolError(f"--nnodes {self.count} must be at least 1")
        if self.count == 1:
            return
        if self.endpoint is None or self.run_id is None:
            raise DeeppoolError(f"--nnodes {self.count} needs --rdzv-endpoint HOST:PORT and --rdzv-id ID, "
                                "the same on every machine")
        host, _, port = self.endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise DeeppoolError(f"--rdzv-endpoint '{self.endpoint}' is not HOST:PORT, e.g. node0:29500")


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    """What to measure: ranks, message sizes (bytes), repeats, warm-up runs, timeout."""

    nproc: int = 2
    sizes: tuple[int, ...] = DEFAULT_SIZES
    repeats: int = 10
    warmup: int = 3
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.nproc < 2:
            raise DeeppoolError(f"--nproc {self.nproc}: measuring a network needs at least 2 processes")
        if not self.sizes or min(self.sizes) < 4:
            sizes = ",".join(map(str, self.sizes))
            raise DeeppoolError(f"--sizes {sizes}: every message size must be at least 4 bytes")
        if self.repeats < 1:
            raise DeeppoolError(f"--repeats {self.repeats} must be at least 1")
        if self.warmup < 0:
            raise DeeppoolError(f"--warmup {self.warmup} must be >= 0")
