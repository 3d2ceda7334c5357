"""Typed configuration of a run (validated at construction)."""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from deeppool import options
from deeppool.adaptation.kfac_options import KfacOptions
from deeppool.device import GPU_BACKEND
from deeppool.errors import DeeppoolError
from deeppool.options import Default, nested, option
from deeppool.plans import Combine, Optimizer, Precision
from deeppool.plans.jsonio import read_json, write_json

if TYPE_CHECKING:  # torch loads when an optimizer is built: the CLI checks options without it
    import torch

    from deeppool.plans import Plan


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


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    kind: Optimizer = option(Optimizer.SGD, help="optimizer", flag="--optimizer")
    lr: float = option(0.01, help="learning rate")
    momentum: float = option(0.0, help="SGD momentum (also K-FAC's SGD)")
    kfac: KfacOptions = nested(default_factory=KfacOptions, prefix="kfac-")
    """K-FAC's hyperparameters (``--optimizer kfac``)."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise DeeppoolError(f"--lr {self.lr} must be positive")
        if not 0 <= self.momentum < 1:
            raise DeeppoolError(f"--momentum {self.momentum} must be in [0, 1)")

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        import torch

        params = list(params)
        if self.kind is Optimizer.ADAM:
            return torch.optim.Adam(params, lr=self.lr)
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)  # K-FAC's too: it preconditions the grads


class BatchNormMode(enum.Enum):
    """Whose statistics a BatchNorm layer on several ranks normalises with."""

    SYNC = "sync"
    """The layer's whole batch, summed over its ranks (:mod:`deeppool.model.syncbn`): exact to
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

    kind: ScheduleKind = option(ScheduleKind.CONSTANT, flag="--lr-schedule",
                                help="learning rate after warm-up: constant, or decaying to 0")
    warmup_steps: int = option(0, flag="--lr-warmup", help="optimizer steps of linear learning-rate warm-up")
    total_steps: int = 1
    """The run's steps (``--steps``)."""

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

    accumulate: int = option(1, help="global batches whose gradients are summed per optimizer step")
    """Global batches (of ``plan.global_batch`` samples) whose gradients are summed per optimizer step."""
    clip_norm: float | None = option(None, help="clip gradients to this global L2 norm (whole model)")
    """Scale gradients so their global L2 norm (over every parameter of the model) is at most this."""
    schedule: Schedule = nested(default_factory=Schedule)

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

    monitor: Monitor = option(Monitor.NONE, help="gns: measure the gradient noise scale per layer group "
                              "(summary.json 'gns', a trace counter)")
    lr_scaling: LrScaling = option(LrScaling.NONE, help="adascale: scale the LR by AdaScale's gain (measures the "
                                   "noise scale), schedule by τ")
    base_batch: int | None = option(None, help="AdaScale's base batch, the batch --lr is tuned for",
                                    shown="global batch / the widest layer's GPUs")
    combine: Combine | None = option(None, help="how a layer group combines gradients: sum (the mean gradient) or "
                                     "adasum", shown="the plan's")

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


@dataclass(frozen=True, kw_only=True)
class LossScaling:
    """Dynamic loss scaling for fp16, as ``torch.amp.GradScaler``: the scale is multiplied by
    ``backoff`` after a step with an inf/NaN gradient (the step is skipped) and by ``growth`` after
    ``interval`` steps without one."""

    initial: float = option(2.0**16, flag="--loss-scale", help="fp16: the initial loss scale")
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

    factory: str = option(help="train on the map-style Dataset this returns (package.module:factory or "
                          "file.py:factory); each rank loads only its rows", flag="--data",
                          shown="the model's synthetic batch")
    seed: int = option(0, flag="--data-seed", help="seed of the per-epoch sample order (seed + epoch)")
    """Epoch ``e`` visits the samples in the order ``torch.randperm(len, Generator().manual_seed(seed + e))``."""
    workers: int = option(0, flag="--data-workers", help="DataLoader worker processes per rank")

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

    directory: Path = option(flag="--checkpoint-dir", help="directory for checkpoints (one shard per layer group)")
    every: int = option(0, flag="--checkpoint-every", help="write a checkpoint every N optimizer steps (0: never)")
    resume: bool = option(False, flag="--resume", help="continue from the latest complete checkpoint")
    stop_file: Path | None = option(
        None, flag="--stop-file", help="stop resumably after the step at which this file appears: a checkpoint is "
        "written and <out>/stopped.json says after which step (the coordinator resizes a job so)")

    def __post_init__(self) -> None:
        if self.every < 0:
            raise DeeppoolError(f"--checkpoint-every {self.every} must be >= 0")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """How to run a plan: steps, optimizer, backend, timeouts, checking, outputs."""

    steps: int = option(50, help="training iterations, warm-up included")
    warmup: int = option(5, help="the first iterations, left out of the timing medians (fewer than --steps)",
                         command_default=Default(None, "5, or --steps - 1 when --steps is 5 or less"))
    optimizer: OptimizerConfig = nested(default_factory=OptimizerConfig,
                                        defaults={"kind": Default(None, "the plan's")})
    backend: Backend = option(Backend.AUTO, help="auto: NCCL with CUDA, else gloo")
    timeout_s: float = option(DEFAULT_TIMEOUT_S, flag="--timeout", help="seconds before a stalled communication fails")
    bucket_mb: float = option(25.0, help="gradient bucket size in MiB (0: per stage, synchronous)")
    check: bool = option(False, flag="--check", help="also train one process in lockstep; compare gradients, "
                         "buffers and parameters every step")
    check_bound: float | None = option(
        None, help="largest relative difference --check accepts (per tensor: gradients and buffers against their own "
        "norm, parameters against their module's scale; measured fp32 round-off after a few steps: about 1e-6 on "
        "transformers, up to 7e-5 on deep BatchNorm CNNs such as densenet121, and it grows with depth and steps)",
        shown="1e-3 (fp32), 1e-2 (fp16), 5e-2 (bf16)")
    """None: the precision's default (:attr:`Precision.check_bound`)."""
    out_dir: Path | None = option(None, flag="--out", help="directory for traces, summary.json and error records",
                                  command_default=Default(Path("deeppool-run")))
    training: Training = nested(default_factory=Training)
    checkpoint: CheckpointConfig | None = nested(default=None)
    policy: str | None = option(
        None, flag="--policy", help="adapt the run: grow-batch (grow the batch by accumulation while the noise scale "
        "says it pays; needs --monitor gns), or module:factory / file.py:factory returning a policy")
    """``--policy``: a built-in adaptation policy or ``module:factory`` (:mod:`deeppool.adaptation.policy`)."""
    monitor_every: int = option(10, help="steps per all-gather of the ranks' step and compute times (stragglers, "
                                "policies' snapshots)")
    adaptation: Adaptation = nested(default_factory=Adaptation)
    precision: Precision = option(Precision.FP32, flag="--precision", help="forward under autocast to bf16 or fp16 "
                                  "(fp16 with loss scaling); weights stay fp32")
    loss_scaling: LossScaling = nested(default_factory=LossScaling)
    """Used with ``precision=Precision.FP16`` only."""
    data: DataConfig | None = nested(default=None)
    """A dataset that each rank samples only its rows of (``--data``); None: the model's synthetic batch."""
    batchnorm: BatchNormMode = option(
        BatchNormMode.SYNC, flag="--batchnorm", help="BatchNorm statistics of a layer on several ranks: sync (the "
        "whole batch's, exact to one process) or local (each rank's own samples, as DDP with nn.BatchNorm; not exact, "
        "refused with --check)")

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise DeeppoolError(f"--steps {self.steps} must be at least 1")
        if self.warmup < 0:
            raise DeeppoolError(f"--warmup {self.warmup} must be >= 0")
        if self.timeout_s <= 0:
            raise DeeppoolError(f"--timeout {self.timeout_s} must be positive")
        if self.precision is Precision.TF32:
            raise DeeppoolError("--precision tf32 is a planning figure: run with --precision fp32 (TF32 products "
                                "follow torch.backends.cuda.matmul.allow_tf32)")
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

    def to_json(self) -> dict[str, Any]:
        return options.to_json(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunConfig:
        """The config of :meth:`to_json`'s form (a field left out takes its default)."""
        return options.from_json(cls, data, where="run config")


CONFIG_FILE = "config.json"
"""The file in a run's ``--out`` that the launcher hands every rank (:class:`RankConfig`)."""


@dataclass(frozen=True, kw_only=True)
class RankConfig:
    """What every rank of a run is given, as one file (:data:`CONFIG_FILE`, written by the launcher): the run's
    config, and the settings of the layers above the executor by name (the multiplexer's ``background``), which
    the executor carries without reading."""

    run: RunConfig
    extra: dict[str, Any] = field(default_factory=dict)

    KIND: ClassVar[str] = "run config"
    SCHEMA_VERSION: ClassVar[int] = 1

    def save(self, path: Path) -> None:
        write_json(path, {"artifact": self.KIND, "schema_version": self.SCHEMA_VERSION, "run": self.run.to_json(),
                          **self.extra})

    @classmethod
    def load(cls, path: Path) -> RankConfig:
        payload = read_json(path, kind=cls.KIND, schema_version=cls.SCHEMA_VERSION)
        extra = {key: value for key, value in payload.items() if key not in ("artifact", "schema_version", "run")}
        return cls(run=RunConfig.from_json(payload.get("run", {})), extra=extra)


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
    if config.optimizer.kind is Optimizer.KFAC and combine is Combine.ADASUM:
        raise DeeppoolError("--optimizer kfac preconditions the mean gradient, and Adasum does not give it: run "
                            "K-FAC with --combine sum")
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


@dataclass(frozen=True, kw_only=True)
class Nodes:
    """Where a run's ranks are: this machine alone, or ``count`` machines meeting at a rendezvous.

    As torchrun's ``--nnodes N --rdzv-endpoint HOST:PORT --rdzv-id ID``: the same command runs on every
    machine, each starts ``--nproc`` ranks, and the rendezvous gives them their global ranks. The first
    machine to reach ``HOST:PORT`` (the one whose address it is) hosts the rendezvous store.
    """

    count: int = option(1, flag="--nnodes", help="machines the run spans (the same command on each)")
    endpoint: str | None = option(None, flag="--rdzv-endpoint", help="HOST:PORT where the machines meet (with "
                                  "--nnodes > 1), as torchrun's")
    run_id: str | None = option(None, flag="--rdzv-id", help="the run's id, the same on every machine")

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
