"""AdaScale (Johnson et al., ICML 2020): scale the learning rate with the batch by the gain ratio.

Training at ``S`` times a base batch ``B₀`` with the gradient noise ``tr(Σ)``
and the true gradient's squared norm ``|G|²`` (:mod:`deeppool.adaptation.gns`),
one step makes as much progress as ``r`` base steps, where

    σ² = tr(Σ) / B₀        (the variance of a base-batch gradient)
    r  = (σ² + |G|²) / (σ²/S + |G|²),   1 ≤ r ≤ S.

AdaScale takes the learning rate ``r · lr(τ)`` and counts progress in
scale-invariant iterations, ``τ += r``, indexing the schedule by ``τ``, so
training at any scale follows the same curve against ``τ``. With noise-free
gradients ``r = 1`` (a larger batch buys nothing); with pure noise ``r = S``
(the linear scaling rule). For Adam, as adaptdl does, the factor is ``√r``
(Adam's step is already normalised by the gradient's scale).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from deeppool.errors import DeeppoolError

Schedule = Callable[[float], float]


def gain_ratio(trace: float, grad_sq: float, *, base_batch: int, batch: int) -> float:
    """r in [1, S] for S = batch / base_batch; 1 before the estimates are usable."""
    if base_batch < 1 or batch < base_batch:
        raise DeeppoolError(f"AdaScale needs batch >= base batch >= 1, got {batch} and {base_batch}")
    scale = batch / base_batch
    if not (math.isfinite(trace) and math.isfinite(grad_sq)):
        return 1.0
    var, sq = max(trace, 0.0) / base_batch, max(grad_sq, 0.0)
    if var + sq <= 0:
        return 1.0
    return min(scale, max(1.0, (var + sq) / (var / scale + sq)))


@dataclass
class AdaScale:
    """Scale-invariant progress ``tau`` and the LR multiplier of the current step."""

    base_batch: int
    batch: int
    adam: bool = False
    tau: float = 0.0
    gain: float = 1.0

    def step(self, trace: float, grad_sq: float, schedule: Schedule) -> float:
        """The learning rate for this step, ``gain · schedule(tau)``; then ``tau`` advances by the gain."""
        return self.advance(self.gain_for(trace, grad_sq), schedule)

    def gain_for(self, trace: float, grad_sq: float) -> float:
        """The gain ratio at this scale for these statistics (the state is not changed)."""
        return gain_ratio(trace, grad_sq, base_batch=self.base_batch, batch=self.batch)

    def advance(self, gain: float, schedule: Schedule) -> float:
        """Take a step with ``gain`` (computed elsewhere): the learning rate ``gain^p · schedule(tau)``,
        ``p`` 1, or ½ for Adam; then ``tau`` advances by the gain."""
        self.gain = gain
        factor = math.sqrt(gain) if self.adam else gain
        lr = factor * schedule(self.tau)
        self.tau += gain
        return lr

    def state_dict(self) -> dict[str, float]:
        return {"tau": self.tau, "gain": self.gain}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.tau, self.gain = float(state["tau"]), float(state["gain"])
