"""The plans the ILP is compared against, costed by the same cost model.

* **Data parallel**: every layer on all GPUs (at most one per sample).
* **DeepPool-style dynamic programme** (Park et al., MLSys 2022): GPU counts
  restricted to powers of two, layers taken in topological order as a chain
  (Viterbi over the count of the previous layer, so only the edge to the
  previous layer is costed while choosing; the full graph is costed after),
  and the amplification limit applied *softly*: a layer whose amplification
  ``a`` exceeds the limit ``A`` pays ``(a − A) · t₁`` extra in the programme,
  ``t₁`` being its one-GPU time. Memory is not constrained, as in DeepPool.
"""

from __future__ import annotations

from deeppool.planner.candidates import powers_of_two
from deeppool.planner.cost import CostModel


def data_parallel(cost: CostModel, gpus: int) -> dict[str, int]:
    width = min(gpus, cost.global_batch)
    return {layer.name: width for layer in cost.graph.layers}


def deeppool_dp(cost: CostModel, gpus: int, amplification: float | None) -> dict[str, int]:
    counts = powers_of_two(gpus, cost.global_batch)
    layers = cost.graph.layers
    best: dict[int, float] = {g: 0.0 for g in counts}
    choices: list[dict[int, int]] = []
    previous = None
    for layer in layers:
        local = {g: cost.layer_ms(layer, g) + _penalty(cost, layer, g, amplification) for g in counts}
        feeds = previous is not None and previous.name in layer.inputs
        step: dict[int, float] = {}
        back: dict[int, int] = {}
        for g in counts:
            options = {
                p: best[p] + (2 * cost.reshard_ms(previous, p, g) if feeds else 0.0) for p in counts
            }
            back[g] = min(options, key=options.__getitem__)
            step[g] = options[back[g]] + local[g]
        best, previous = step, layer
        choices.append(back)
    g = min(best, key=best.__getitem__)
    assignment: dict[str, int] = {}
    for layer, back in zip(reversed(layers), reversed(choices), strict=True):
        assignment[layer.name] = g
        g = back[g]
    return tie(cost, assignment)


def tie(cost: CostModel, assignment: dict[str, int]) -> dict[str, int]:
    """Layers that share a parameter take the count of the first of them (DeepPool knew no sharing)."""
    tied = dict(assignment)
    for group in cost.graph.tied():
        for name in group[1:]:
            tied[name] = tied[group[0]]
    return tied


def _penalty(cost: CostModel, layer, gpus: int, amplification: float | None) -> float:
    if amplification is None:
        return 0.0
    single = cost.layer_ms(layer, 1)
    return max(0.0, cost.amplification(layer, gpus) - amplification) * single
