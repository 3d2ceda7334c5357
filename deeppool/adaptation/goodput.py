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


