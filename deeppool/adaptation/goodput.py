"""Goodput (Pollux, Qiao et al., OSDI 2021): throughput times statistical efficiency.

Training at a global batch ``M`` makes, per sample, a fraction

    E(M) = (φ + M₀) / (φ + M)

of the progress it makes at the base batch ``M₀``, with ``φ`` the gradient
noise scale (:mod:`deeppool.adaptation.gns`). ``E(M) = r / S`` for AdaScale's
gain ``r`` at scale ``S = M / M₀``. Goodput, the progress per second in
base-batch samples, is ``throughput(M) · E(M)``, where throughput (samples/s)
comes from deeppool's own plan for that batch, not from a data-parallel fit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from deeppool.errors import DeeppoolError


def statistical_efficiency(batch: int, *, base_batch: int, noise_scale: float) -> float:
    if batch < 1 or base_batch < 1:
        raise DeeppoolError(f"batch sizes must be positive, got {batch} and {base_batch}")
    if noise_scale < 0:
        raise DeeppoolError(f"--gns {noise_scale} must be at least 0 (samples)")
    return (noise_scale + base_batch) / (noise_scale + batch)


@dataclass(frozen=True, kw_only=True)
class BatchChoice:
    batch: int
    iteration_s: float
    efficiency: float
    gpus: int = 0
    """GPUs the plan for this batch uses (0: not recorded)."""

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.batch / self.iteration_s

    @property
    def goodput(self) -> float:
        """Base-batch-equivalent samples per second."""
        return self.throughput * self.efficiency


def goodput_table(batches: Iterable[int], iteration_s: Callable[[int], float], *, base_batch: int,
                  noise_scale: float) -> list[BatchChoice]:
    """Each candidate batch with its planned iteration time, efficiency and goodput, in batch order."""
    return [BatchChoice(batch=b, iteration_s=iteration_s(b),
                        efficiency=statistical_efficiency(b, base_batch=base_batch, noise_scale=noise_scale))
            for b in sorted(set(batches))]


@dataclass(frozen=True, kw_only=True)
class GoodputSearch:
    """A search over global batches: each candidate's planned figures, and which one has the best goodput."""

    noise_scale: float
    base_batch: int
    choices: tuple[BatchChoice, ...]

    @property
    def chosen(self) -> BatchChoice:
        return best(self.choices)

    def to_json(self) -> dict[str, object]:
        return {"noise_scale": self.noise_scale, "base_batch": self.base_batch, "chosen_batch": self.chosen.batch,
                "choices": [{"batch": c.batch, "iteration_s": c.iteration_s, "efficiency": c.efficiency,
                             "gpus": c.gpus, "throughput": c.throughput, "goodput": c.goodput}
                            for c in self.choices]}

    @classmethod
    def from_json(cls, data: dict) -> GoodputSearch:
        return cls(noise_scale=float(data["noise_scale"]), base_batch=int(data["base_batch"]),
                   choices=tuple(BatchChoice(batch=int(c["batch"]), iteration_s=float(c["iteration_s"]),
                                             efficiency=float(c["efficiency"]), gpus=int(c["gpus"]))
                                 for c in data["choices"]))


def best(choices: Iterable[BatchChoice]) -> BatchChoice:
    choices = list(choices)
    if not choices:
        raise DeeppoolError("no batch size to choose from: give at least one candidate")
    return max(choices, key=lambda c: c.goodput)
