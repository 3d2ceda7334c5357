"""The gradient noise scale (McCandlish et al. 2018), from gradient norms at two batch sizes.

With the squared norm of a gradient averaged over ``B_s`` samples, ``|G_s|²``,
and over ``B_b > B_s`` samples, ``|G_b|²`` (both unbiased in expectation:
``E|G_B|² = |G|² + tr(Σ)/B``), the unbiased estimators are

    |G|²  ≈ (B_b·|G_b|² − B_s·|G_s|²) / (B_b − B_s)
    tr(Σ) ≈ (|G_s|² − |G_b|²) / (1/B_s − 1/B_b)

and the simple noise scale is ``B_noise = tr(Σ) / |G|²``, in samples: about
the batch beyond which a larger batch stops paying. Each estimate is noisy
(and may be negative), so, as adaptdl does, each is smoothed by its own
exponential moving average with bias correction and the noise scale is their
*ratio of means*.

In a burst-parallel plan every layer group has its own size: a group of ``g``
ranks sees ``B/g`` rows per rank before its all-reduce and ``B`` after. The
estimators are linear in the norms, so each group's ``|G|²`` and ``tr(Σ)``
are computed with its own batch sizes and the results add up across groups
(the squared norm and the trace both add over parameter blocks). A group of
one rank has only one batch size and gives nothing: it is left out, and
:attr:`GroupNorms.fraction` says how much of the model was covered.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from deeppool.errors import DeeppoolError


@dataclass(frozen=True, kw_only=True)
class GroupNorms:
    """One layer group's squared gradient norms in one step.

    ``small_sq`` is the mean over the group's ranks of each rank's local squared norm (``small_batch``
    rows each), ``large_sq`` the squared norm after the all-reduce (``large_batch`` rows).
    """

    small_sq: float
    small_batch: int
    large_sq: float
    large_batch: int

    def __post_init__(self) -> None:
        if not 0 < self.small_batch <= self.large_batch:
            raise DeeppoolError(f"batch sizes must satisfy 0 < small <= large: {self.small_batch}, {self.large_batch}")

    @property
    def informative(self) -> bool:
        return self.large_batch > self.small_batch

    def grad_sq(self) -> float:
        """Unbiased |G|² for this group."""
        bs, bb = self.small_batch, self.large_batch
        return (bb * self.large_sq - bs * self.small_sq) / (bb - bs)

    def trace(self) -> float:
        """Unbiased tr(Σ) (per-sample gradient variance, summed over coordinates) for this group."""
        bs, bb = self.small_batch, self.large_batch
        return (self.small_sq - self.large_sq) / (1 / bs - 1 / bb)


@dataclass(frozen=True, kw_only=True)
class StepEstimate:
    """One step's raw estimates, summed over the informative groups."""

    grad_sq: float
    trace: float
    groups: int
    skipped: int


def step_estimate(groups: Iterable[GroupNorms]) -> StepEstimate | None:
    """Sum the groups' estimates; None when no group has two batch sizes (every group on one rank)."""
    groups = list(groups)
    used = [g for g in groups if g.informative]
    if not used:
        return None
    return StepEstimate(grad_sq=sum(g.grad_sq() for g in used), trace=sum(g.trace() for g in used),
                        groups=len(used), skipped=len(groups) - len(used))


@dataclass
class _Ema:
    smoothing: float
    value: float = 0.0
    weight: float = 0.0

    def update(self, x: float) -> None:
        self.value = (1 - self.smoothing) * self.value + self.smoothing * x
        self.weight = (1 - self.smoothing) * self.weight + self.smoothing

    @property
    def mean(self) -> float:
        return self.value / self.weight if self.weight > 0 else math.nan


class NoiseScale:
    """Moving averages of |G|² and tr(Σ); :attr:`value` is their ratio (samples).

    ``smoothing`` is the EMA's weight on each new step (adaptdl uses 0.1 at its default
    accumulation). :meth:`state_dict` / :meth:`load_state_dict` carry it across a resume.
    """

    def __init__(self, smoothing: float = 0.1) -> None:
        if not 0 < smoothing <= 1:
            raise DeeppoolError(f"noise-scale smoothing {smoothing} must be in (0, 1]")
        self._sq = _Ema(smoothing)
        self._trace = _Ema(smoothing)
        self.steps = 0

    def update(self, estimate: StepEstimate | None) -> float:
        if estimate is not None:
            self._sq.update(estimate.grad_sq)
            self._trace.update(estimate.trace)
            self.steps += 1
        return self.value

    @property
    def grad_sq(self) -> float:
        return self._sq.mean

    @property
    def trace(self) -> float:
        return self._trace.mean

    @property
    def value(self) -> float:
        """B_noise = EMA(tr Σ) / EMA(|G|²); nan before any step, inf when |G|² is not positive yet."""
        if self.steps == 0:
            return math.nan
        sq, trace = self.grad_sq, max(self.trace, 0.0)
        return trace / sq if sq > 0 else math.inf

    def state_dict(self) -> dict[str, float]:
        return {"sq": self._sq.value, "sq_weight": self._sq.weight, "trace": self._trace.value,
                "trace_weight": self._trace.weight, "steps": self.steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self._sq.value, self._sq.weight = float(state["sq"]), float(state["sq_weight"])
        self._trace.value, self._trace.weight = float(state["trace"]), float(state["trace_weight"])
        self.steps = int(state["steps"])
