"""What a person looks at: the plan as a rich table, a summary line and a Gantt chart."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from deeppool.planner.cost import CostModel, PhaseKind
from deeppool.planner.plan import Plan, PlannedLayer

_PHASE_COLOURS = {
    PhaseKind.FORWARD: "#4C72B0",
    PhaseKind.BACKWARD: "#DD8452",
    PhaseKind.ALLREDUCE: "#C44E52",
    PhaseKind.RESHARD: "#8172B3",
    PhaseKind.OPTIMIZER: "#55A868",
}


@dataclass(frozen=True)
class Stage:
    """Consecutive layers that use the same GPU count."""

    layers: tuple[PlannedLayer, ...]

    @property
    def first(self) -> PlannedLayer:
        return self.layers[0]

    @property
    def last(self) -> PlannedLayer:
        return self.layers[-1]

    @property
    def gpus(self) -> int:
        return self.first.gpus

    @property
    def time_ms(self) -> float:
        return sum(layer.busy_ms for layer in self.layers)

    @property
    def amplification(self) -> float:
        return max(layer.amplification for layer in self.layers)


def stages(plan: Plan) -> list[Stage]:
    groups: list[list[PlannedLayer]] = []
    for layer in plan.layers:
        if groups and groups[-1][-1].gpus == layer.gpus:
            groups[-1].append(layer)
        else:
            groups.append([layer])
    return [Stage(tuple(group)) for group in groups]


def plan_table(plan: Plan, *, per_layer: bool = False) -> Table:
    """Per stage (default) or per layer: GPUs, predicted time, amplification."""
    table = Table(title=f"{plan.strategy.value} plan: {plan.gpus} GPUs, global batch {plan.global_batch}, {plan.device}")
    table.add_column("layers" if not per_layer else "layer")
    table.add_column("op(s)")
    table.add_column("GPUs", justify="right")
    table.add_column("time ms", justify="right")
    table.add_column("amplification", justify="right")
    if per_layer:
        for layer in plan.layers:
            table.add_row(layer.name, layer.op, str(layer.gpus), f"{layer.busy_ms:.3f}", f"{layer.amplification:.2f}")
        return table
    for stage in stages(plan):
        span = stage.first.name if len(stage.layers) == 1 else f"{stage.first.name} … {stage.last.name}"
        ops = ", ".join(dict.fromkeys(layer.op for layer in stage.layers))
        table.add_row(
            f"{span} ({len(stage.layers)})", _shorten(ops), str(stage.gpus),
            f"{stage.time_ms:.3f}", f"{stage.amplification:.2f}",
        )
    return table


def _shorten(text: str, width: int = 40) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def summary(plan: Plan) -> str:
    """One line, leading with the comparison a user would make: the best data-parallel width."""
    p = plan.predicted
    return (
        f"iteration {p.iteration_ms:.3f} ms, {p.speedup_vs_best_data_parallel:.2f}x vs data parallel at its best "
        f"width ({p.best_data_parallel_gpus} GPUs, {p.best_data_parallel_iteration_ms:.3f} ms); "
        f"{p.speedup_vs_data_parallel:.2f}x vs data parallel on all {plan.gpus} GPUs "
        f"({p.data_parallel_iteration_ms:.3f} ms), DeepPool's planner {p.deeppool_iteration_ms:.3f} ms; "
        f"{p.gpu_seconds_per_iteration:.4f} GPU-s/iteration, amplification {p.amplification:.2f}, "
        f"idle {100 * p.idle_gpu_fraction:.1f}% of {plan.gpus} GPUs, {plan.precision.value}; "
        f"solver {plan.solver.name} {plan.solver.status} in {plan.solver.seconds:.2f} s (gap {plan.solver.gap:.2g})"
    )


def gantt(plan: Plan, cost: CostModel, path: str | Path) -> None:
    """A PNG of GPUs × time in one iteration: phases coloured, idle windows grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    phases = cost.schedule(plan.assignment)
    iteration = plan.predicted.iteration_ms
    figure, axes = plt.subplots(figsize=(12, 4 + min(plan.gpus, 64) / 16))
    axes.add_patch(Rectangle((0, 0), iteration, plan.gpus, color="#E5E5E5", linewidth=0))
    for phase in phases:
        axes.add_patch(
            Rectangle(
                (phase.start_ms, 0), phase.end_ms - phase.start_ms, phase.ranks,
                color=_PHASE_COLOURS[phase.kind], linewidth=0,
            )
        )
    axes.set_xlim(0, iteration)
    axes.set_ylim(plan.gpus, 0)
    axes.set_xlabel("time in one iteration (ms)")
    axes.set_ylabel("GPU rank")
    axes.set_title(
        f"{plan.strategy.value} plan on {plan.gpus} GPUs: {iteration:.2f} ms/iteration, "
        f"{100 * plan.predicted.idle_gpu_fraction:.0f}% idle (grey, lent to background jobs)"
    )
    handles = [Patch(color=colour, label=kind.value) for kind, colour in _PHASE_COLOURS.items()]
    handles.append(Patch(color="#E5E5E5", label="idle"))
    axes.legend(handles=handles, loc="lower right", fontsize="small")
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
