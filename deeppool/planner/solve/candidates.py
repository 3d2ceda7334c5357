"""Which GPU counts a layer may use, and the limits that rule some out.

Pruning, and why it loses nothing: a layer on ``g`` GPUs has per-GPU batch
``s(g) = ⌈B/g⌉``. Among all counts with the same ``s`` only the smallest is
kept: its compute time is the same, and its all-reduce time, reshard side
time, GPU-time and amplification are no larger (the cost model's terms grow
with ``g`` at fixed ``s``). Replacing every layer's count by that smallest
count also maps equal counts to equal counts, so no reshard is added. Hence
the optimum over the kept counts equals the optimum over all of 1..G (counts
above ``B`` leave GPUs without samples and are never better). For B = 256
this leaves 31 counts out of 256; the test suite checks the claim against
enumeration over every count. Large problems may further be thinned to a
fixed number of counts (:func:`thinned_counts`), which is not lossless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deeppool.errors import DeeppoolError
from deeppool.model.graph import Layer
from deeppool.planner.hardware import GIB
from deeppool.planner.solve.cost import CostModel


def useful_counts(gpus: int, global_batch: int) -> tuple[int, ...]:
    """The smallest GPU count for every distinct per-GPU batch ⌈B/g⌉, g ≤ min(G, B)."""
    counts = []
    previous = None
    for g in range(1, min(gpus, global_batch) + 1):
        share = math.ceil(global_batch / g)
        if share != previous:
            counts.append(g)
            previous = share
    return tuple(counts)


def thinned_counts(gpus: int, global_batch: int, limit: int | None) -> tuple[int, ...]:
    """About ``limit`` of the useful counts (all of them when ``limit`` is None).

    This pruning can cost plan quality (the planner benchmark measures how
    much): it keeps every power of two and the data-parallel width, so the
    data-parallel and DeepPool plans stay representable, and fills the gaps with
    the useful counts nearest to a geometric series from 1 to the largest count
    (then the widest remaining gaps), up to ``limit`` counts.
    """
    counts = useful_counts(gpus, global_batch)
    if limit is None or len(counts) <= limit:
        return counts
    kept = set(powers_of_two(gpus, global_batch)) | {counts[-1]}
    spread = max(limit - len(kept), 2)
    for step in range(spread):
        target = counts[-1] ** (step / (spread - 1))
        kept.add(min(counts, key=lambda g: abs(math.log(g / target))))
    while len(kept) < limit:  # the series hit some counts twice: fill the widest gaps
        kept.add(max((g for g in counts if g not in kept), key=lambda g: min(abs(math.log(g / k)) for k in kept)))
    return tuple(sorted(kept))


def powers_of_two(gpus: int, global_batch: int) -> tuple[int, ...]:
    limit = min(gpus, global_batch)
    return tuple(2**k for k in range(limit.bit_length()) if 2**k <= limit)


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Hard limits of a planning problem."""

    amplification: float | None = None
    memory_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.amplification is not None and self.amplification < 1:
            raise DeeppoolError(
                f"--amplification {self.amplification} is below 1: a layer's GPU-time on g GPUs "
                "can never be below its time on one, use a limit >= 1"
            )


def allowed_counts(cost: CostModel, layer: Layer, counts: tuple[int, ...], limits: Limits) -> tuple[int, ...]:
    """The counts within the amplification limit (1 GPU always is)."""
    if limits.amplification is None:
        return counts
    bound = limits.amplification + 1e-9
    return tuple(g for g in counts if g == 1 or cost.amplification(layer, g) <= bound)


def check_memory(cost: CostModel, options: dict[str, tuple[int, ...]], limits: Limits) -> None:
    """Refuse a problem whose smallest-memory choice already exceeds the device."""
    if limits.memory_bytes is None:
        return
    needs = {
        layer.name: min(cost.memory_bytes(layer, g) for g in options[layer.name])
        for layer in cost.graph.layers
    }
    total = sum(needs.values())
    if total <= limits.memory_bytes:
        return
    worst = max(needs, key=needs.__getitem__)
    raise DeeppoolError(
        f"infeasible: rank 0 needs at least {total / GIB:.2f} GiB but the device has "
        f"{limits.memory_bytes / GIB:.2f} GiB; layer '{worst}' alone needs {needs[worst] / GIB:.2f} GiB "
        "(weights, gradients, optimizer state, activations): lower --batch, add GPUs or relax --amplification"
    )
