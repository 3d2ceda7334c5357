"""Goodput (Pollux, Qiao et al., OSDI 2021): throughput times statistical efficiency.

Training at a global batch ``M`` makes, per sample, a fraction

    E(M) = (φ + M₀) / (φ + M)

of the progress it makes at the base batch ``M₀``, with ``φ`` the gradient
noise scale (:mod:`deeppool.adaptation.gns`). ``E(M) = r / S`` for AdaScale's
gain ``r`` at scale ``S = M / M₀``. Goodput, the progress per second in
base-batch samples, is ``throughput(M) · E(M)``, where throughput (samples/s)
comes from deeppool's own plan for that batch, or, for a job the coordinator
runs, from :class:`IterationFit`, fitted to the iterations it measured.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from deeppool.errors import DeeppoolError
from deeppool.plans import BatchChoice


def statistical_efficiency(batch: int, *, base_batch: int, noise_scale: float) -> float:
    if batch < 1 or base_batch < 1:
        raise DeeppoolError(f"batch sizes must be positive, got {batch} and {base_batch}")
    if noise_scale < 0:
        raise DeeppoolError(f"--gns {noise_scale} must be at least 0 (samples)")
    return (noise_scale + base_batch) / (noise_scale + batch)


def goodput_table(batches: Iterable[int], iteration_s: Callable[[int], float], *, base_batch: int,
                  noise_scale: float) -> list[BatchChoice]:
    """Each candidate batch with its planned iteration time, efficiency and goodput, in batch order."""
    return [BatchChoice(batch=b, iteration_s=iteration_s(b),
                        efficiency=statistical_efficiency(b, base_batch=base_batch, noise_scale=noise_scale))
            for b in sorted(set(batches))]




@dataclass(frozen=True, kw_only=True)
class IterationFit:
    """A job's iteration time on ``g`` GPUs at global batch ``M``, fitted to the iterations it was measured at:

        T(g, M) = α + β · M / g

    ``β`` is seconds per sample on one GPU (the part that shrinks as the per-GPU batch does), ``α`` what does
    not (synchronisation, fixed costs). Least squares over the measured ``(g, M, T)`` with ``α, β ≥ 0``;
    measurements at one per-GPU batch only give ``α = 0`` (linear scaling, the prior until a second per-GPU
    batch is measured). Throughput is ``M / T(g, M)`` samples per second.
    """

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and self.beta >= 0 and self.alpha + self.beta > 0):
            raise DeeppoolError(f"an iteration time model needs alpha, beta >= 0, not both 0: {self}")

    @classmethod
    def fit(cls, measured: Sequence[tuple[int, int, float]]) -> IterationFit:
        """The fit to ``(gpus, batch, iteration_s)`` measurements (at least one, every time positive)."""
        if not measured or any(gpus < 1 or batch < 1 or not seconds > 0 for gpus, batch, seconds in measured):
            raise DeeppoolError(f"an iteration time model needs positive measurements, got {list(measured)}")
        xs = [batch / gpus for gpus, batch, _ in measured]
        ts = [seconds for _, _, seconds in measured]
        mean_x, mean_t = sum(xs) / len(xs), sum(ts) / len(ts)
        spread = sum((x - mean_x) ** 2 for x in xs)
        if spread > 0:
            beta = sum((x - mean_x) * (t - mean_t) for x, t in zip(xs, ts, strict=True)) / spread
            alpha = mean_t - beta * mean_x
            if beta > 0 and alpha >= 0:
                return cls(alpha=alpha, beta=beta)
            if beta <= 0:
                return cls(alpha=mean_t, beta=0.0)
        return cls(alpha=0.0, beta=sum(x * t for x, t in zip(xs, ts, strict=True)) / sum(x * x for x in xs))

    def iteration_s(self, gpus: int, batch: int) -> float:
        return self.alpha + self.beta * batch / gpus

    def throughput(self, gpus: int, batch: int) -> float:
        return batch / self.iteration_s(gpus, batch)


def adascale_gain(batch: int, *, base_batch: int, noise_scale: float) -> float:
    """Base-batch steps one step at ``batch`` is worth: ``S · E(M)`` for ``S = M / M₀`` (AdaScale's gain ``r``),
    which also multiplies the learning rate (SGD)."""
    return batch / base_batch * statistical_efficiency(batch, base_batch=base_batch, noise_scale=noise_scale)
