"""Adaptation policies with monitoring, as in KungFu (Mai et al., OSDI 2020).

The executor's training loop calls an :class:`AdaptationPolicy`'s hooks, ``before_step``,
``after_step`` and ``after_epoch``, with a :class:`TrainingSnapshot` of what it
monitors, and applies the actions they return: :class:`SetLr` (the base
learning rate; the ``--lr-schedule`` factor still applies), :class:`SetAccumulate`
(the micro-batches per optimizer step, so the batch is ``K × global_batch``;
the loss is scaled by ``1/K``, so a step's gradient stays the mean over its
samples) and :class:`RequestGpus` (stop resumably and re-plan for that many).

Every rank builds the same snapshot (its figures are all-gathered) and runs
the policy itself, so a policy must be a deterministic function of the
snapshots it is given; then every rank takes the same actions at the same step.

The built-in policy is :class:`GrowBatch`.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from deeppool.adaptation.stragglers import Straggler
from deeppool.errors import DeeppoolError


@dataclass(frozen=True, kw_only=True)
class TrainingSnapshot:
    """What the executor monitors, as of the last optimizer step (before the first: no times yet)."""

    step: int
    """Optimizer steps done."""
    position: int
    """Global batches (of ``global_batch`` samples) trained on."""
    gpus: int
    global_batch: int
    accumulate: int
    lr: float
    """The base learning rate (``--lr``, or the last :class:`SetLr`)."""
    step_ms: tuple[float, ...] = ()
    """The last optimizer step's wall time per rank."""
    compute_ms: tuple[float, ...] = ()
    """The last optimizer step's compute time per rank (forward, backward, optimizer; no waiting)."""
    gns: float | None = None
    """The gradient noise scale in samples, when monitored (``--monitor gns``; rank 0's smoothed estimate,
    ``inf`` while the smoothed ``|G|²`` is not positive: the noise dominates)."""
    stragglers: tuple[Straggler, ...] = ()
    """The ranks flagged as stragglers and not recovered."""

    @property
    def batch(self) -> int:
        """Samples per optimizer step."""
        return self.global_batch * self.accumulate

    @property
    def samples_per_s(self) -> float | None:
        """Throughput of the last step: its samples over the slowest rank's time."""
        slowest = max(self.step_ms, default=0.0)
        return 1e3 * self.batch / slowest if slowest > 0 else None


@dataclass(frozen=True, kw_only=True)
class SetLr:
    lr: float

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise DeeppoolError(f"a policy set the learning rate to {self.lr}: it must be positive")


@dataclass(frozen=True, kw_only=True)
class SetAccumulate:
    accumulate: int

    def __post_init__(self) -> None:
        if self.accumulate < 1:
            raise DeeppoolError(f"a policy set accumulation to {self.accumulate}: it must be at least 1")


@dataclass(frozen=True, kw_only=True)
class RequestGpus:
    gpus: int
    reason: str = ""

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise DeeppoolError(f"a policy asked for {self.gpus} GPUs: ask for at least 1")


Action = SetLr | SetAccumulate | RequestGpus


class AdaptationPolicy(Protocol):
    """Hooks around each optimizer step and pass over the data; each returns the actions to take."""

    def before_step(self, snapshot: TrainingSnapshot) -> Sequence[Action]: ...

    def after_step(self, snapshot: TrainingSnapshot) -> Sequence[Action]: ...

    def after_epoch(self, snapshot: TrainingSnapshot) -> Sequence[Action]: ...


class Hooks:
    """A policy that does nothing: subclass it and override the hooks you need."""

    def before_step(self, snapshot: TrainingSnapshot) -> Sequence[Action]:
        del snapshot
        return ()

    def after_step(self, snapshot: TrainingSnapshot) -> Sequence[Action]:
        del snapshot
        return ()

    def after_epoch(self, snapshot: TrainingSnapshot) -> Sequence[Action]:
        del snapshot
        return ()


@dataclass(frozen=True, kw_only=True)
class GrowBatch(Hooks):
    """Double the batch (through accumulation) while the noise scale says a larger one pays.

    McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training"): the
    critical batch is about the noise scale, ``B_crit ≈ B_noise``. Below it, a
    step's progress grows almost linearly with the batch (``B`` times the
    samples give nearly ``B`` times the progress per step, so the same data
    take fewer, equally fast steps per sample); above it, extra samples are
    wasted. So, every ``interval`` steps, when the doubled batch is still at
    most ``B_noise / factor`` (``B_noise ≥ 2·factor·B``), the policy doubles
    ``K``; with ``factor`` = 2 the batch stays at most half the noise scale.
    ``K`` is capped at ``max_accumulate``. It never shrinks the batch, and
    leaves the learning rate alone (AdaScale's gain is the tool for that).
    """

    factor: float = 2.0
    interval: int = 10
    max_accumulate: int = 64

    def __post_init__(self) -> None:
        if self.factor < 1 or self.interval < 1 or self.max_accumulate < 1:
            raise DeeppoolError(f"grow-batch settings out of range: {self}")

    def after_step(self, snapshot: TrainingSnapshot) -> Sequence[Action]:
        if snapshot.gns is None or snapshot.step % self.interval != 0 or snapshot.accumulate >= self.max_accumulate:
            return ()
        if snapshot.gns < self.factor * 2 * snapshot.batch:
            return ()
        return (SetAccumulate(accumulate=min(2 * snapshot.accumulate, self.max_accumulate)),)


class BuiltIn(enum.Enum):
    """The policies ``--policy`` names."""

    GROW_BATCH = "grow-batch"


def load_policy(text: str) -> AdaptationPolicy:
    """``--policy``: a built-in name, or ``module:factory`` / ``file.py:factory`` returning an
    :class:`AdaptationPolicy`."""
    known = {kind.value: kind for kind in BuiltIn}
    if text in known:
        return GrowBatch()
    where, _, name = text.rpartition(":")
    if not where or not name.isidentifier():
        raise DeeppoolError(f"--policy '{text}' is neither a built-in ({', '.join(known)}) nor module:factory "
                            "(or file.py:factory)")
    factory = getattr(_module(where, text), name, None)
    if not callable(factory):
        raise DeeppoolError(f"--policy '{text}': '{where}' has no function '{name}'")
    policy: Any = factory()
    if not all(callable(getattr(policy, hook, None)) for hook in ("before_step", "after_step", "after_epoch")):
        raise DeeppoolError(f"--policy '{text}': {name}() must return a policy with before_step, after_step "
                            "and after_epoch (subclass deeppool.adaptation.policy.Hooks)")
    return policy


def _module(where: str, text: str) -> Any:
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise DeeppoolError(f"--policy '{text}': no file '{where}'")
        spec = importlib.util.spec_from_file_location(f"deeppool_policy_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(where)
    except ImportError as err:
        raise DeeppoolError(f"--policy '{text}': cannot import '{where}' ({err})") from None
