"""The plans the ILP is compared against, costed by the same cost model.

* **Data parallel** on all ``G`` GPUs (at most one per sample), and the
  **best data parallel** over every ``g ≤ G``: what a user would really run
  instead (one count per distinct per-GPU batch suffices, as in
  :mod:`deeppool.planner.solve.candidates`; ties go to fewer GPUs).
* **DeepPool's planner** (Park et al., MLSys 2022, §4), written here from the
  paper: GPU counts are powers of two; layers are visited in topological
  order and a layer's best time on ``g`` GPUs is its own time plus, over its
  inputs, the **maximum** of each input's best time (including the reshard
  into ``g``) — branches are assumed to run side by side and join at the
  slowest; and the amplification limit ``A`` is **soft**: a count whose
  amplification ``a`` exceeds ``A`` stays allowed but pays ``(a − A) · t₁``
  (``t₁`` the layer's one-GPU time) in the search, so a large speed-up can
  still buy it. Memory is not constrained, as in DeepPool. The chosen counts
  are then costed by the one cost model (branches run one after another).
"""

from __future__ import annotations

from dataclasses import dataclass

from deeppool.model.graph import Layer
from deeppool.planner.solve.candidates import powers_of_two, useful_counts
from deeppool.planner.solve.cost import CostModel


@dataclass(frozen=True, kw_only=True)
class Baselines:
    """The baselines' predicted iteration times, from the same cost model as the plan."""

    data_parallel_ms: float
    deeppool_ms: float
    best_data_parallel_gpus: int
    best_data_parallel_ms: float


def data_parallel(cost: CostModel, gpus: int) -> dict[str, int]:
    width = min(gpus, cost.global_batch)
    return {layer.name: width for layer in cost.graph.layers}


def best_data_parallel(cost: CostModel, gpus: int) -> tuple[int, dict[str, int]]:
    """The data-parallel width ``g ≤ G`` with the least predicted iteration time, and its plan."""
    timed = {g: cost.iteration_ms(data_parallel(cost, g)) for g in useful_counts(gpus, cost.global_batch)}
    best = min(timed, key=lambda g: (timed[g], g))
    return best, data_parallel(cost, best)


def deeppool(cost: CostModel, gpus: int, amplification: float | None) -> dict[str, int]:
    """DeepPool's search: powers of two, the slowest input at a join, a soft amplification limit."""
    counts = powers_of_two(gpus, cost.global_batch)
    producers = {layer.name: layer for layer in cost.graph.layers}
    best: dict[str, dict[int, float]] = {}
    back: dict[str, dict[str, dict[int, int]]] = {}
    for layer in cost.graph.layers:
        inputs = [name for name in dict.fromkeys(layer.inputs) if name in producers]
        back[layer.name] = {name: {} for name in inputs}
        best[layer.name] = {}
        for g in counts:
            arrivals = [0.0]
            for name in inputs:
                options = {p: best[name][p] + cost.round_trip_ms(producers[name], p, g) for p in counts}
                back[layer.name][name][g] = min(options, key=options.__getitem__)
                arrivals.append(options[back[layer.name][name][g]])
            local = cost.layer_ms(layer, g) + _penalty(cost, layer, g, amplification)
            best[layer.name][g] = max(arrivals) + local
    return tie(cost, _walk_back(cost, best, back))


def _walk_back(
    cost: CostModel, best: dict[str, dict[int, float]], back: dict[str, dict[str, dict[int, int]]]
) -> dict[str, int]:
    """Counts from the output back along the choices; a layer reached twice keeps its first count."""
    assignment: dict[str, int] = {}
    for layer in reversed(cost.graph.layers):
        if layer.name not in assignment:
            assignment[layer.name] = min(best[layer.name], key=best[layer.name].__getitem__)
        g = assignment[layer.name]
        for name, choice in back[layer.name].items():
            assignment.setdefault(name, choice[g])
    return assignment


def tie(cost: CostModel, assignment: dict[str, int]) -> dict[str, int]:
    """Layers that share a parameter take the count of the first of them (DeepPool knew no sharing)."""
    tied = dict(assignment)
    for group in cost.graph.tied():
        for name in group[1:]:
            tied[name] = tied[group[0]]
    return tied


def _penalty(cost: CostModel, layer: Layer, gpus: int, amplification: float | None) -> float:
    if amplification is None:
        return 0.0
    single = cost.layer_ms(layer, 1)
    return max(0.0, cost.amplification(layer, gpus) - amplification) * single
