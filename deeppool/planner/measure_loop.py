"""Measure what the plan uses: plan, see which per-GPU batches the plan and its baselines run, measure
those not measured yet, plan again, until the plan rests only on measured points.

A layer's time at a per-GPU batch no one measured comes from a line fitted through the measured ones;
a layer bound by reading its weights at small batches takes longer at large ones than such a line says.
So the local planner starts from a few
small batches (powers of two up to 8), solves, and measures every per-GPU batch that the chosen plan
or a baseline (data parallel on all GPUs, at its best width, DeepPool's planner) uses, and the
one-GPU batch when an amplification limit compares against it; each round measures at least one
new batch, so the loop ends. ``--max-measured-batch`` caps the batches measured, and so does the memory
free for a profiling pass (which runs the whole model at the batch, where a plan runs only some layers
at it: :meth:`~deeppool.planner.profiling.profiler.LayerProfiler.fits`): the loop then stops with the batches
beyond fitted, and the plan says which of its layers rest on them
(:class:`~deeppool.plans.plan.Evidence`). The loop does not care where it measures: a CUDA device
goes through it as the CPU does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from deeppool.errors import DeeppoolError
from deeppool.model.batching import normalises_batch
from deeppool.model.layer_exec import LayerFailed
from deeppool.plans import Evidence
from deeppool.planner.profiling.profile import Profile
from deeppool.planner.profiling.profiler import LayerProfiler
from deeppool.planner.solve.cost import CostModel

if TYPE_CHECKING:
    from deeppool.planner.api import Planned

FIRST_LARGEST = 8
"""The loop's first round measures powers of two up to this per-GPU batch (or the cap, if smaller)."""


def first_batches(cap: int | None, needed: int) -> tuple[int, ...]:
    """The per-GPU batches measured before the first solve: powers of two up to ``FIRST_LARGEST``, the cap
    and ``needed`` (the largest the planner may use), from 2 when 3 remain."""
    limit = min(FIRST_LARGEST, needed, cap or FIRST_LARGEST)
    powers = tuple(2**k for k in range(limit.bit_length()))
    return powers[1:] if len(powers) > 3 else powers


def used_batches(cost: CostModel, assignments: Mapping[object, Mapping[str, int]], *,
                 one_gpu: bool) -> tuple[int, ...]:
    """Every per-GPU batch that the ``assignments`` (a plan and its baselines) run; with ``one_gpu`` also
    the one-GPU batch (the global batch), which an amplification limit compares every layer against."""
    counts = {gpus for assignment in assignments.values() for gpus in assignment.values()}
    if one_gpu:
        counts.add(1)
    return tuple(sorted({cost.per_gpu_batch(gpus) for gpus in counts}))


def evidence(cost: CostModel, chosen: Mapping[str, int], assignments: Mapping[object, Mapping[str, int]], *,
             one_gpu: bool) -> Evidence | None:
    """What a plan measured here rests on (None for an estimated profile)."""
    profile = cost.profile
    if profile.source != "measured" or profile.fit is None:
        return None
    measured = profile.measured_batches
    batch = {name: cost.per_gpu_batch(gpus) for name, gpus in chosen.items()}
    conditions = profile.conditions
    return Evidence(
        measured_batches=measured,
        extrapolated=tuple(name for name in cost.graph.names if batch[name] not in measured),
        unmeasured_batches=tuple(b for b in used_batches(cost, assignments, one_gpu=one_gpu) if b not in measured),
        busy=tuple(name for name in cost.graph.names if profile.busy(name, batch[name])),
        load=conditions.load if conditions else 0.0,
        cores=conditions.cores if conditions else 1,
        sharing={g: profile.sharing(g) for g in sorted(set(chosen.values())) if g > 1},
    )


def plan_on_measured(profiler: LayerProfiler, solve: Callable[[Profile], Planned], *, targets: tuple[int, ...],
                     cap: int | None, one_gpu: bool) -> Planned:
    """Measure, solve, and measure what the solution uses until it uses nothing unmeasured (at most ``cap``).

    ``targets`` are the per-GPU batches the planner may use (the profile fits the unmeasured ones);
    ``solve`` plans on a profile."""
    first = first_batches(cap, max(targets))
    failed: dict[int, LayerFailed] = {}
    measure_each(profiler, [b for b in first if profiler.fits(b)] or first[:1], failed)
    while True:
        planned = solve(profiler.profile(targets))
        used = used_batches(planned.cost, planned.assignments, one_gpu=one_gpu)
        todo = [b for b in used if b not in profiler.batches and b not in failed and (cap is None or b <= cap)
                and profiler.fits(b)]
        if not todo:
            return planned
        measure_each(profiler, todo, failed)


def measure_each(profiler: LayerProfiler, batches: list[int], failed: dict[int, LayerFailed]) -> None:
    """Measure ``batches``, the largest first; a batch at which a BatchNorm layer cannot run on its own (one
    value per channel) is left to the fit and noted in ``failed``: the executor runs such a layer on its
    GPUs as one group (BatchNorm over the layer's whole batch), so the count is not refused; only a model
    that no measurable batch runs is, with the layer's error. Any other op that fails at a batch is that
    error, one line naming the layer and op."""
    for batch in sorted(set(batches), reverse=True):
        try:
            profiler.measure([batch])
        except LayerFailed as err:
            if not normalises_batch(profiler.traced.module, err.layer):
                raise  # another op: the executor would fail there too, so no plan may use this batch
            failed[batch] = err
    if not profiler.batches:
        smallest = min(failed)
        raise DeeppoolError(f"{failed[smallest]}; nothing could be measured at per-GPU batches {sorted(failed)}: "
                            "raise --max-measured-batch or --batch")
