"""Typed configuration of a run (validated at construction)."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from deeppool.device import GPU_BACKEND
from deeppool.errors import DeeppoolError
from deeppool.planner.combine import Combine

if TYPE_CHECKING:  # torch loads when an optimizer is built: the CLI checks options without it
    import torch

    from deeppool.planner.plan import Plan


class Backend(enum.Enum):
    AUTO = "auto"
    GLOO = "gloo"
    NCCL = GPU_BACKEND

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
    """The layer's whole batch, summed over its ranks (:mod:`deeppool.planner.syncbn`): exact to
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

    def factor(self, step: float) -> float:
        """The multiplier of ``--lr`` at optimizer step ``step`` (0-based; AdaScale's τ, a float, with
        ``--lr-scaling adascale``)."""
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


class Monitor(enum.Enum):
    """What the run measures beyond its times (``--monitor``)."""

    NONE = "none"
    GNS = "gns"
    """The gradient noise scale (:mod:`deeppool.executor.engine.monitor`)."""


class LrScaling(enum.Enum):
    """How the learning rate follows the batch (``--lr-scaling``)."""

    NONE = "none"
    ADASCALE = "adascale"
    """AdaScale's gain ratio, with the schedule indexed by scale-invariant progress τ."""


@dataclass(frozen=True, kw_only=True)
class Adaptation:
    """Adapting training to its batch: the noise-scale monitor, AdaScale and the combine override.

    ``base_batch`` is AdaScale's ``B₀`` (``--base-batch``; None: the plan's global batch over its widest
    layer's GPU count, the batch one rank of plain data parallelism would see). ``combine`` overrides the
    plan's choice of how a layer group combines its gradients (None: the plan's).
    """

    monitor: Monitor = Monitor.NONE
    lr_scaling: LrScaling = LrScaling.NONE
    base_batch: int | None = None
    combine: Combine | None = None

    def __post_init__(self) -> None:
        if self.base_batch is not None and self.base_batch < 1:
            raise DeeppoolError(f"--base-batch {self.base_batch} must be at least 1")
        if self.base_batch is not None and self.lr_scaling is LrScaling.NONE:
            raise DeeppoolError("--base-batch sets AdaScale's base batch: give it with --lr-scaling adascale")
        if self.combine is Combine.ADASUM and self.measures:
            raise DeeppoolError("--combine adasum does not give the mean gradient the noise scale is measured on: "
                                "drop --monitor gns and --lr-scaling adascale, or use --combine sum")

    @property
    def measures(self) -> bool:
        """Gradient norms are measured: the monitor is on, or AdaScale needs its statistics."""
        return self.monitor is Monitor.GNS or self.lr_scaling is LrScaling.ADASCALE
class Precision(enum.Enum):
    """The arithmetic of the forward: fp32, or autocast to bf16 / fp16 (parameters and optimizer stay fp32)."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def scaled(self) -> bool:
        """fp16 needs its loss scaled, so small gradients do not flush to zero."""
        return self is Precision.FP16

    @property
    def check_bound(self) -> float:
        """``--check``'s default bound: round-off of this precision's products, with a margin
        (measured figures in docs/executor.md, "Mixed precision")."""
        return {Precision.FP32: 1e-3, Precision.FP16: 1e-2, Precision.BF16: 5e-2}[self]

    @property
    def check_floor(self) -> float:
        """``--check``'s floor for a tensor's norm, as a fraction of the largest of its kind: a gradient that
        cancels exactly (a bias right before BatchNorm) comes out as this precision's round-off of the
        large terms, so the floor grows with the precision's epsilon (docs/executor.md, "Mixed precision")."""
        return {Precision.FP32: 1e-3, Precision.FP16: 2e-2, Precision.BF16: 1e-1}[self]


@dataclass(frozen=True, kw_only=True)
class LossScaling:
    """Dynamic loss scaling for fp16, as ``torch.amp.GradScaler``: the scale is multiplied by
    ``backoff`` after a step with an inf/NaN gradient (the step is skipped) and by ``growth`` after
    ``interval`` steps without one."""

    initial: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    interval: int = 2000

    def __post_init__(self) -> None:
        if not self.initial > 0:
            raise DeeppoolError(f"--loss-scale {self.initial} must be positive")
        if self.growth <= 1 or not 0 < self.backoff < 1 or self.interval < 1:
            raise DeeppoolError("loss scaling needs growth > 1, 0 < backoff < 1 and interval >= 1")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Training data: a map-style ``Dataset`` from ``factory`` (``package.module:callable`` or
    ``path/file.py:callable``), sampled in a seeded order per epoch."""

    factory: str
    seed: int = 0
    """Epoch ``e`` visits the samples in the order ``torch.randperm(len, Generator().manual_seed(seed + e))``."""
    workers: int = 0
    """DataLoader worker processes per rank (0: load in the training process)."""

    def __post_init__(self) -> None:
        module, _, attr = self.factory.rpartition(":")
        if not module or not attr.isidentifier():
            raise DeeppoolError(f"--data '{self.factory}' is not module:factory, e.g. mydata:train_set "
                                "(or path/to/data.py:train_set)")
        if self.workers < 0:
            raise DeeppoolError(f"--data-workers {self.workers} must be >= 0")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where checkpoints go (:mod:`deeppool.executor.training.checkpoint`), how often, and whether to resume."""

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
    check_bound: float | None = None
    """None: the precision's default (:attr:`Precision.check_bound`)."""
    out_dir: Path | None = None
    training: Training = field(default_factory=Training)
    checkpoint: CheckpointConfig | None = None
    policy: str | None = None
    """``--policy``: a built-in adaptation policy or ``module:factory`` (:mod:`deeppool.adaptation.policy`)."""
    monitor_every: int = 10
    """Steps per all-gather of the ranks' step and compute times (:mod:`deeppool.executor.training.steptimes`)."""
    adaptation: Adaptation = field(default_factory=Adaptation)
    precision: Precision = Precision.FP32
    loss_scaling: LossScaling = field(default_factory=LossScaling)
    """Used with ``precision=Precision.FP16`` only."""
    data: DataConfig | None = None
    """A dataset that each rank samples only its rows of (``--data``); None: the model's synthetic batch."""
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
        if self.check_bound is not None and self.check_bound <= 0:
            raise DeeppoolError(f"--check-bound {self.check_bound} must be positive")
        if self.check and self.checkpoint is not None and self.checkpoint.resume:
            raise DeeppoolError("--check trains its reference from the start: run --resume without --check")
        if self.monitor_every < 1:
            raise DeeppoolError(f"--monitor-every {self.monitor_every} must be at least 1")
        if self.check and self.policy is not None:
            raise DeeppoolError(f"--check trains its reference with fixed settings: run --policy {self.policy} "
                                "without --check")
        if self.check and self.adaptation.lr_scaling is LrScaling.ADASCALE:
            raise DeeppoolError("--check compares with plain training at --lr: run --lr-scaling adascale without --check")
        if self.check and self.adaptation.combine is Combine.ADASUM:
            raise DeeppoolError("--check compares with the mean gradient: run --combine adasum without --check")
        if self.precision.scaled and self.adaptation.measures:
            raise DeeppoolError("--monitor gns and --lr-scaling adascale measure unscaled gradients: "
                                "use --precision bf16 or fp32 with them, not fp16's scaled loss")

        if self.check and self.batchnorm is BatchNormMode.LOCAL:
            raise DeeppoolError("--check compares with single-process training, whose BatchNorm uses the whole "
                                "batch's statistics: run --check with --batchnorm sync")

    @property
    def bound(self) -> float:
        """The largest relative difference ``--check`` accepts."""
        return self.precision.check_bound if self.check_bound is None else self.check_bound

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)


def default_base_batch(plan: Plan) -> int:
    """AdaScale's ``B₀`` when ``--base-batch`` is not given: the global batch over the widest layer's GPU count."""
    return max(1, plan.global_batch // max(layer.gpus for layer in plan.layers))


def check_adaptation(plan: Plan, config: RunConfig, *, grouped: bool) -> None:
    """The adaptation options fit the plan, or one line says what to change.

    ``grouped``: some layer with parameters runs on two or more GPUs (the launcher, which has not traced
    the model, passes whether any layer's plan has an all-reduce time).
    """
    adaptation = config.adaptation
    combine = adaptation.combine or plan.combine
    if combine is Combine.ADASUM and (adaptation.measures or config.check):
        raise DeeppoolError("the plan combines gradients with Adasum, not the mean gradient that --check, "
                            "--monitor gns and --lr-scaling adascale need: drop them, or run with --combine sum")
    if adaptation.measures and not grouped:
        flag = "--lr-scaling adascale" if adaptation.lr_scaling is LrScaling.ADASCALE else "--monitor gns"
        raise DeeppoolError(f"{flag} compares gradients before and after a layer group's all-reduce, and no layer "
                            "with parameters runs on two or more GPUs in this plan: re-plan with more GPUs")
    if adaptation.lr_scaling is not LrScaling.ADASCALE:
        return
    batch = plan.global_batch * config.training.accumulate
    base = adaptation.base_batch or default_base_batch(plan)
    if base > batch:
        raise DeeppoolError(f"--base-batch {base} is more than a step's batch of {batch} samples (the plan's global "
                            f"batch x --accumulate): give at most {batch}")


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
    """The fewest timed repeats of each pattern and size."""
    min_seconds: float = 0.4
    """Repeats go on until each pattern and size has taken about this long (at most ``max_repeats``): a
    collective on a shared host has a heavy tail (a few ms in one call of three), and what an iteration
    pays is its mean, which takes many repeats to see."""
    max_repeats: int = 200
    warmup: int = 3
    timeout_s: float = 120.0
    busy_ms: float = 10.0
    """How much the ranks of a group compute together (a fixed amount of work, this long on rank 0 alone)
    before they send to rank 0 or sum a tensor (a stage's compute, a backward's end)."""

    def __post_init__(self) -> None:
        if self.nproc < 2:
            raise DeeppoolError(f"--nproc {self.nproc}: measuring a network needs at least 2 processes")
        if not self.sizes or min(self.sizes) < 4:
            sizes = ",".join(map(str, self.sizes))
            raise DeeppoolError(f"--sizes {sizes}: every message size must be at least 4 bytes")
        if self.repeats < 1:
            raise DeeppoolError(f"--repeats {self.repeats} must be at least 1")
        if self.max_repeats < self.repeats or self.min_seconds < 0:
            raise DeeppoolError(f"the most repeats ({self.max_repeats}) must be >= --repeats ({self.repeats}) "
                                "and the time per size >= 0")
        if self.warmup < 0:
            raise DeeppoolError(f"--warmup {self.warmup} must be >= 0")
