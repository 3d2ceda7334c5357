"""The trade-off a user can see: iteration time against GPU-seconds per iteration.

:func:`front` re-solves the ILP of a planned problem under DeepPool's
objective ``T + price · GPU-time`` for a sweep of prices (from nearly free
GPUs to dear ones), keeps the plans no other plan beats on both axes, and
adds the baselines: data parallel at every useful width, the best of them,
and DeepPool's planner. :func:`plot` draws them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from deeppool.plans import Objective, Strategy
from deeppool.planner.api import Planned
from deeppool.planner.solve import baselines
from deeppool.planner.solve.candidates import useful_counts
from deeppool.planner.solve.cost import CostModel
from deeppool.planner.solve.ilp import solve
from deeppool.planner.strategies import search_options

PRICE_FACTORS = (0.0, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 1e3, 1e4)
"""Prices swept, as multiples of the all-GPU data-parallel plan's ms per GPU-second."""


@dataclass(frozen=True, kw_only=True)
class Point:
    label: str
    iteration_ms: float
    gpu_seconds: float


@dataclass(frozen=True, kw_only=True)
class Front:
    ilp: tuple[Point, ...]
    data_parallel: tuple[Point, ...]
    best_data_parallel: Point
    deeppool: Point
    chosen: Point


def _point(cost: CostModel, label: str, assignment: dict[str, int]) -> Point:
    return Point(label=label, iteration_ms=cost.iteration_ms(assignment), gpu_seconds=cost.gpu_seconds(assignment))


def front(planned: Planned) -> Front:
    """The ILP's Pareto front over the price sweep, and the baselines, in one cost model."""
    cost, search = planned.cost, planned.search
    options = search_options(cost, search)
    dp = baselines.data_parallel(cost, search.gpus)
    unit = cost.iteration_ms(dp) / max(cost.gpu_seconds(dp), 1e-12)
    points = []
    for factor in PRICE_FACTORS:
        priced = replace(search, objective=Objective.TIME_AND_GPU_TIME, price=factor * unit) if factor else search
        result = solve(cost, options, memory_bytes=search.limits.memory_bytes, time_limit_s=search.time_limit_s,
                       solver=search.solver, price=priced.weight)
        points.append(_point(cost, f"price {factor:g}", result.assignment))
    widths = useful_counts(search.gpus, cost.global_batch)
    best_gpus, best = baselines.best_data_parallel(cost, search.gpus)
    return Front(
        ilp=_pareto(points),
        data_parallel=tuple(_point(cost, f"{g}", baselines.data_parallel(cost, g)) for g in widths),
        best_data_parallel=_point(cost, f"best data parallel ({best_gpus} GPUs)", best),
        deeppool=_point(cost, "DeepPool's planner", planned.assignments[Strategy.DEEPPOOL]),
        chosen=_point(cost, _chosen_label(planned), planned.plan.assignment),
    )


def _chosen_label(planned: Planned) -> str:
    shares = planned.plan.cluster
    if planned.plan.objective is not Objective.CLUSTER or shares is None:
        return "written plan"
    return (f"written plan: best cluster throughput, {shares.throughput:.2f}x data parallel "
            f"(fg {shares.fg_share:.2f} + bg {shares.bg_share:.2f})")


def _pareto(points: list[Point]) -> tuple[Point, ...]:
    """The points no other point beats on both axes, by GPU-seconds."""
    kept: list[Point] = []
    for point in sorted(points, key=lambda p: (p.gpu_seconds, p.iteration_ms)):
        if not kept or point.iteration_ms < kept[-1].iteration_ms - 1e-12:
            kept.append(point)
    return tuple(kept)


def plot(result: Front, path: str | Path) -> None:
    """A PNG: the ILP's front as a line, data parallel widths as a dotted line, the other baselines as marks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5.5))
    dp = sorted(result.data_parallel, key=lambda p: p.gpu_seconds)
    axes.plot([p.gpu_seconds for p in dp], [p.iteration_ms for p in dp], ":", color="#888888", marker=".",
              label="data parallel on g GPUs")
    axes.plot([p.gpu_seconds for p in result.ilp], [p.iteration_ms for p in result.ilp], "-o", color="#4C72B0",
              label="ILP front (time + price · GPU-time)")
    marks = ((result.best_data_parallel, "s", "#C44E52"), (result.deeppool, "^", "#55A868"),
             (result.chosen, "*", "#DD8452"))
    for point, marker, colour in marks:
        axes.plot(point.gpu_seconds, point.iteration_ms, marker, color=colour, markersize=11, label=point.label,
                  linestyle="none")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("GPU-seconds per iteration (log)")
    axes.set_ylabel("iteration time (ms, log)")
    axes.set_title("iteration time against GPU-time: lower left is better")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small", loc="upper right")
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
