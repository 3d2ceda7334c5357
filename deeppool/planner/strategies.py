"""The ILP and its baselines in one run, with an honest account of what the solver did.

:func:`solve_all` computes data parallel on all GPUs, the best data parallel
over ``g ≤ G``, DeepPool's planner and the ILP under one cost model. The
written ILP plan is never predicted worse than a feasible baseline: when the
solver finds nothing (time-out, failure) or something worse, the best
feasible baseline is kept and the status says so; when the candidate counts
were thinned, the status says over how many the optimum holds.

Objectives (``--objective``): ``time`` minimises the iteration time under the
amplification cap; ``time+gpu-time`` is DeepPool's trade-off, minimising
``T + price · Σ_l g_l · layer_ms_l(g_l) / 1000`` (``price`` in ms of iteration
per GPU-second; reshard GPU-time is left out of the price term, so the ILP
stays exact); ``cluster`` maximises the cluster's throughput, searched exactly
(to a stated tolerance) by :mod:`deeppool.planner.solve.throughput` with the ILP as
its oracle.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

from deeppool.errors import DeeppoolError
from deeppool.plans import Objective, Pin, SolverInfo, Strategy
from deeppool.planner.profiling.interference import InterferenceModel
from deeppool.planner.request import check_objective
from deeppool.planner.solve import baselines
from deeppool.planner.solve.baselines import Baselines
from deeppool.planner.solve.candidates import Limits, allowed_counts, check_memory, thinned_counts, useful_counts
from deeppool.planner.solve.cost import CostModel
from deeppool.planner.solve.ilp import SolverName, default_solver, solve
from deeppool.planner.solve.pins import apply_pins, pinned_counts
from deeppool.planner.solve.throughput import (
    DEFAULT_TOLERANCE,
    ClusterProblem,
    ClusterSearch,
    cluster_optimum,
    priced_gpu_ms,
)


@dataclass(frozen=True, kw_only=True)
class Search:
    """How to search: GPUs, limits, candidate thinning, solver and objective."""

    gpus: int
    limits: Limits
    max_candidates: int | None
    time_limit_s: float
    solver: SolverName | None = None
    objective: Objective = Objective.TIME
    price: float = 0.0
    pins: tuple[Pin, ...] = ()
    interference: InterferenceModel = InterferenceModel()
    """How background work fills idle windows, for ``Objective.CLUSTER`` and the plan's cluster shares."""
    cluster_gap: float = DEFAULT_TOLERANCE
    """``Objective.CLUSTER``: stop once no plan can beat the best costed one by more than this share."""

    def __post_init__(self) -> None:
        check_objective(self.objective, self.price)

    @property
    def weight(self) -> float:
        return self.price if self.objective is Objective.TIME_AND_GPU_TIME else 0.0


@dataclass(frozen=True, kw_only=True)
class Solved:
    assignments: dict[Strategy, dict[str, int]]
    baselines: Baselines
    solver: SolverInfo
    cluster: ClusterSearch | None = None
    """With ``Objective.CLUSTER``: the exact search's result (the ILP strategy's assignment is its plan)."""


def objective_ms(cost: CostModel, assignment: Mapping[str, int], price: float) -> float:
    """What the ILP minimises: ``T + price · (Σ_l g_l · layer_ms_l(g_l) + Σ_g g · ROUNDS(g)) / 1000``."""
    return cost.iteration_ms(assignment) + price * priced_gpu_ms(cost, assignment) / 1e3


def search_options(cost: CostModel, search: Search) -> dict[str, tuple[int, ...]]:
    """Each layer's candidate counts: the (thinned) useful ones within the limits, a pinned layer's one count."""
    counts = thinned_counts(search.gpus, cost.global_batch, search.max_candidates)
    options = {layer.name: allowed_counts(cost, layer, counts, search.limits) for layer in cost.graph.layers}
    check_memory(cost, options, search.limits)
    pinned = pinned_counts(cost, search.pins, search.gpus)
    return apply_pins(cost, options, pinned, search.limits) if pinned else options


def solve_all(cost: CostModel, search: Search) -> Solved:
    """Every strategy's assignment, the baselines' figures and the solver's honest status."""
    useful = useful_counts(search.gpus, cost.global_batch)
    counts = thinned_counts(search.gpus, cost.global_batch, search.max_candidates)
    options = search_options(cost, search)
    best_gpus, best_dp = baselines.best_data_parallel(cost, search.gpus)
    assignments = {
        Strategy.DATA_PARALLEL: baselines.data_parallel(cost, search.gpus),
        Strategy.BEST_DATA_PARALLEL: best_dp,
        Strategy.DEEPPOOL: baselines.deeppool(cost, search.gpus, search.limits.amplification),
    }
    solver = search.solver or default_solver()
    fallback = _best_feasible(cost, assignments, search, pinned_counts(cost, search.pins, search.gpus))
    try:
        result = solve(cost, options, memory_bytes=search.limits.memory_bytes, time_limit_s=search.time_limit_s,
                       solver=solver, price=search.weight)
    except DeeppoolError as failure:
        if fallback is None:
            raise
        strategy, kept = fallback
        assignments[Strategy.ILP] = kept
        status = f"no ILP solution ({failure}); kept the best feasible baseline, {_name(strategy)}"
        info = SolverInfo(name=solver.value, status=status, seconds=search.time_limit_s, gap=1.0)
        solved = Solved(assignments=assignments, baselines=_figures(cost, assignments, best_gpus), solver=info)
        return _for_cluster(cost, search, options, solved) if search.objective is Objective.CLUSTER else solved
    status = result.status
    if len(counts) < len(useful):
        proven = "optimal" if result.optimal else result.status
        status = f"{proven} over {len(counts)} candidate counts (of {len(useful)} useful ones; --max-candidates 0 for all)"
    assignments[Strategy.ILP] = result.assignment
    if fallback is not None:
        strategy, kept = fallback
        if objective_ms(cost, kept, search.weight) < objective_ms(cost, result.assignment, search.weight) * (1 - 1e-9):
            assignments[Strategy.ILP] = kept
            status = f"{status}; {_name(strategy)} is better and is kept"
    info = SolverInfo(name=result.solver.value, status=status, seconds=result.seconds, gap=result.gap)
    solved = Solved(assignments=assignments, baselines=_figures(cost, assignments, best_gpus), solver=info)
    return _for_cluster(cost, search, options, solved) if search.objective is Objective.CLUSTER else solved


def _for_cluster(cost: CostModel, search: Search, options: dict[str, tuple[int, ...]], solved: Solved) -> Solved:
    """The ILP strategy's plan replaced by the one maximising the cluster's throughput (exactly, over
    ``options``), seeded with the time optimum, the baselines and data parallel at every width that keeps
    to the limits and pins (so it is never below right-sizing at the model's efficiency)."""
    pinned = pinned_counts(cost, search.pins, search.gpus)
    widths = [baselines.data_parallel(cost, g) for g in useful_counts(search.gpus, cost.global_batch)]
    seeds = [a for a in (solved.assignments[Strategy.ILP], *solved.assignments.values(), *widths)
             if _within(cost, a, search.limits) and all(a[name] == g for name, g in pinned.items())]
    started = time.perf_counter()
    found = cluster_optimum(ClusterProblem(
        cost=cost, options=options, gpus=search.gpus, dp_ms=solved.baselines.data_parallel_ms,
        model=search.interference, memory_bytes=search.limits.memory_bytes, time_limit_s=search.time_limit_s,
        solver=search.solver, fastest_ms=_fastest_ms(cost, solved), tolerance=search.cluster_gap), seeds)
    seconds = solved.solver.seconds + time.perf_counter() - started
    thinned = solved.solver.status.partition(" over ")[2].partition(";")[0]
    status = found.status + (f" over {thinned}" if thinned else "")
    info = replace(solved.solver, status=status, seconds=seconds, gap=found.tolerance if found.proven else
                   (found.bound - found.shares.throughput) / found.bound)
    assignments = {**solved.assignments, Strategy.ILP: found.assignment}
    return replace(solved, assignments=assignments, solver=info, cluster=found)


def _fastest_ms(cost: CostModel, solved: Solved) -> float:
    """The least iteration time over the options when the ILP proved its optimum (a baseline it kept is no
    slower), else 0: no bound, the search solves for the fastest plan itself."""
    proven = solved.solver.status.startswith("optimal")
    return cost.iteration_ms(solved.assignments[Strategy.ILP]) if proven else 0.0


def _figures(cost: CostModel, assignments: dict[Strategy, dict[str, int]], best_gpus: int) -> Baselines:
    return Baselines(
        data_parallel_ms=cost.iteration_ms(assignments[Strategy.DATA_PARALLEL]),
        deeppool_ms=cost.iteration_ms(assignments[Strategy.DEEPPOOL]),
        best_data_parallel_gpus=best_gpus,
        best_data_parallel_ms=cost.iteration_ms(assignments[Strategy.BEST_DATA_PARALLEL]),
    )


def _best_feasible(
    cost: CostModel, assignments: dict[Strategy, dict[str, int]], search: Search, pinned: dict[str, int]
) -> tuple[Strategy, dict[str, int]] | None:
    """The baseline with the least objective among those within the limits and the pins."""
    feasible = [(s, a) for s, a in assignments.items()
                if _within(cost, a, search.limits) and all(a[name] == g for name, g in pinned.items())]
    return min(feasible, key=lambda item: objective_ms(cost, item[1], search.weight), default=None)


def _within(cost: CostModel, assignment: dict[str, int], limits: Limits) -> bool:
    bound = None if limits.amplification is None else limits.amplification + 1e-9
    for layer in cost.graph.layers:
        g = assignment[layer.name]
        if bound is not None and g > 1 and cost.amplification(layer, g) > bound:
            return False
    for group in cost.graph.tied():
        if len({assignment[name] for name in group}) > 1:
            return False
    return limits.memory_bytes is None or cost.peak_memory_bytes(assignment) <= limits.memory_bytes


def _name(strategy: Strategy) -> str:
    return {
        Strategy.DATA_PARALLEL: "data parallel on all GPUs",
        Strategy.BEST_DATA_PARALLEL: "the best data-parallel width",
        Strategy.DEEPPOOL: "DeepPool's plan",
        Strategy.ILP: "the ILP plan",
    }[strategy]
