"""What a person looks at: the plan as a rich table, a summary line and a Gantt chart."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table

from deeppool.plans import WEAK, Plan, PlannedLayer
from deeppool.planner.solve.cost import CostModel, PhaseKind, SchedulePhase

if TYPE_CHECKING:  # matplotlib loads only when a chart is drawn
    from matplotlib.axes import Axes

_PHASE_COLOURS = {
    PhaseKind.FORWARD: "#4C72B0",
    PhaseKind.BACKWARD: "#DD8452",
    PhaseKind.ALLREDUCE: "#C44E52",
    PhaseKind.RESHARD: "#8172B3",
    PhaseKind.OPTIMIZER: "#55A868",
}


AMPLIFICATION_NOTE = (
    "amplification: a layer's GPU-time (its time x its GPUs) over its time on one GPU; 1.00 is perfect "
    "strong scaling, 2.00 means its GPUs spend twice the GPU-time one GPU would (smaller per-GPU batches, "
    "communication). Burst parallelism keeps it low by giving poorly scaling layers fewer GPUs. The stage table "
    "shows each stage's worst layer; the summary's is the whole iteration's (all GPU-time over all layers' "
    "one-GPU time)."
)
STAGE_AMPLIFICATION = "worst layer amp."
"""The stage table's column: the highest amplification of the stage's layers (the per-layer table's is each
layer's own)."""


@dataclass(frozen=True)
class ReportStage:
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
        """The stage's worst layer's amplification (not the stage's GPU-time over its one-GPU time)."""
        return max(layer.amplification for layer in self.layers)

    @property
    def spread(self) -> float:
        """The stage's confidence: its layers' measurement spreads weighted by their forward+backward time."""
        compute = sum(layer.fwd_ms + layer.bwd_ms for layer in self.layers)
        weighted = sum(layer.spread * (layer.fwd_ms + layer.bwd_ms) for layer in self.layers)
        return weighted / compute if compute > 0 else 0.0


def stages(plan: Plan) -> list[ReportStage]:
    groups: list[list[PlannedLayer]] = []
    for layer in plan.layers:
        if groups and groups[-1][-1].gpus == layer.gpus:
            groups[-1].append(layer)
        else:
            groups.append([layer])
    return [ReportStage(tuple(group)) for group in groups]


def plan_table(plan: Plan, *, per_layer: bool = False) -> Table:
    """Per stage (default) or per layer: GPUs, predicted time, amplification (a stage's: its worst layer's)."""
    table = Table(title=f"{plan.strategy.value} plan: {plan.gpus} GPUs, global batch {plan.global_batch}, {plan.device}")
    table.add_column("layers" if not per_layer else "layer")
    table.add_column("op(s)")
    table.add_column("GPUs", justify="right")
    table.add_column("time ms", justify="right")
    table.add_column("amplification" if per_layer else STAGE_AMPLIFICATION, justify="right")
    measured = plan.evidence is not None
    if measured:
        table.add_column("± spread", justify="right")
    if per_layer:
        for layer in plan.layers:
            table.add_row(layer.name, layer.op, str(layer.gpus), f"{layer.busy_ms:.3f}", f"{layer.amplification:.2f}",
                          *([_percent(layer.spread)] if measured else []))
        return table
    for stage in stages(plan):
        span = stage.first.name if len(stage.layers) == 1 else f"{stage.first.name} … {stage.last.name}"
        ops = ", ".join(dict.fromkeys(layer.op for layer in stage.layers))
        table.add_row(
            f"{span} ({len(stage.layers)})", ops, str(stage.gpus),
            f"{stage.time_ms:.3f}", f"{stage.amplification:.2f}", *([_percent(stage.spread)] if measured else []),
        )
    return table


def _percent(spread: float) -> str:
    return f"{100 * spread:.1f}%"


def _gpus(count: int) -> str:
    return f"{count} GPU" if count == 1 else f"{count} GPUs"


SLOWER = 0.995
"""A plan below this speedup over data parallel is reported as slower, with the limit that made it so."""


def summary(plan: Plan) -> str:
    """One line, leading with the comparison a user would make: the best data-parallel width."""
    p = plan.predicted
    return (
        f"iteration {p.iteration_ms:.3f} ms, {p.speedup_vs_best_data_parallel:.2f}x vs data parallel at its best "
        f"width ({_gpus(p.best_data_parallel_gpus)}, {p.best_data_parallel_iteration_ms:.3f} ms); "
        f"{p.speedup_vs_data_parallel:.2f}x vs data parallel on all {_gpus(plan.gpus)} "
        f"({p.data_parallel_iteration_ms:.3f} ms), DeepPool's planner {p.deeppool_iteration_ms:.3f} ms; "
        f"{p.gpu_seconds_per_iteration:.4f} GPU-s/iteration, whole-iteration amplification {p.amplification:.2f}, "
        f"idle {100 * p.idle_gpu_fraction:.1f}% of {_gpus(plan.gpus)}, {plan.precision.value}; "
        f"solver {plan.solver.name} {plan.solver.status} in {plan.solver.seconds:.2f} s (gap {plan.solver.gap:.2g})"
        f"{_why_slower(plan)}{_weak(plan)}"
    )


def _weak(plan: Plan) -> str:
    """Says so when the iteration's uncertainty (its measurements' spread) exceeds ±15%."""
    uncertainty = plan.predicted.uncertainty
    if uncertainty <= WEAK:
        return ""
    return (f"; weak prediction: the iteration is uncertain by ±{100 * uncertainty:.0f}% (the spread of its layers' "
            f"repeated measurements exceeds ±{100 * WEAK:.0f}%): re-plan on a quieter machine")


def evidence_lines(plan: Plan, shown: int = 6) -> list[str]:
    """What a plan measured here rests on, when it is not only quiet, measured points: the layers whose
    per-GPU batch was above ``--max-measured-batch`` (extrapolated) and those resting on measurements
    taken on a busy machine or that stayed noisy."""
    evidence = plan.evidence
    if evidence is None:
        return []
    lines = []
    if evidence.extrapolated:
        lines.append(f"{len(evidence.extrapolated)} of {len(plan.layers)} layers rest on per-GPU batches not measured "
                     "(above --max-measured-batch, a whole-model pass there would not fit this machine's memory, "
                     "or a layer cannot run there alone), "
                     f"extrapolated from the line fitted through {list(evidence.measured_batches)}: "
                     f"{_names(evidence.extrapolated, shown)}")
    if evidence.unmeasured_batches:
        lines.append(f"per-GPU batches {list(evidence.unmeasured_batches)} that the plan or its baselines use were "
                     "not measured (above --max-measured-batch, too large to measure here, or a layer cannot run there "
                     "alone, such as BatchNorm with one value per channel)")
    if evidence.busy:
        lines.append(f"{len(evidence.busy)} of {len(plan.layers)} layers rest on measurements taken on a busy machine "
                     f"(load up to {evidence.load:.1f} on {evidence.cores} cores), while the host's speed moved, "
                     f"or that stayed noisy: {_names(evidence.busy, shown)} (re-planned on a quieter machine, the "
                     "cache measures them again)")
    return lines


def tracing_lines(plan: Plan) -> list[str]:
    """What the tracer could not make a graph of: each opaque layer (run eagerly as one) and why, and the
    branches on tensor values it specialised (``run`` checks them), by file and line."""
    lines = [f"opaque layer {layer.name} ({layer.op}, run eagerly as one): {layer.opaque}"
             for layer in plan.layers if layer.opaque]
    lines += [f"specialised branch at {branch.file}:{branch.line}: taken {'yes' if branch.taken else 'no'} "
              "(run checks it every step)" for branch in plan.branches]
    return lines


def _names(names: tuple[str, ...], shown: int) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def cluster_line(plan: Plan) -> str:
    """The plan's cluster throughput, its two shares and the right-sizing baseline, each ratio's baseline named."""
    shares = plan.cluster
    if shares is None:
        return ""
    width = shares.right_sizing_gpus
    return (
        f"cluster throughput ({plan.objective.value} objective): {shares.throughput:.3f}x data parallel on all "
        f"{_gpus(plan.gpus)} = foreground share {shares.fg_share:.3f} + background share {shares.bg_share:.3f} "
        f"(lends {100 * shares.lent_fraction:.1f}% of rank-time; efficiencies: {shares.interference}); "
        f"{shares.vs_right_sizing:.3f}x right-sizing (data parallel on {_gpus(width)}, the other {plan.gpus - width} "
        f"at full efficiency: {shares.right_sizing_throughput:.3f}x data parallel on all)"
    )


def _why_slower(plan: Plan) -> str:
    """Which limit rules data parallel out when the plan is slower than it (else data parallel would be chosen)."""
    p = plan.predicted
    if p.speedup_vs_best_data_parallel >= SLOWER or plan.amplification_limit is None:
        return ""
    return (f"; slower than data parallel because --amplification {plan.amplification_limit:g} rules out data "
            f"parallel on {_gpus(p.best_data_parallel_gpus)}: some of its layers would spend more than "
            f"{plan.amplification_limit:g}x their one-GPU time")


def gantt(plan: Plan, cost: CostModel, path: str | Path) -> None:
    """A chart of GPUs x time in one iteration: phases coloured, idle windows grey, stages named on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    phases = cost.schedule(plan.assignment)
    iteration = plan.predicted.iteration_ms
    figure, axes = plt.subplots(figsize=(13, 4.5 + min(plan.gpus, 64) / 16))
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
    _name_stages(axes, plan, phases)
    axes.set_title(
        f"{plan.strategy.value} plan on {plan.gpus} GPUs: {iteration:.2f} ms/iteration, "
        f"{100 * plan.predicted.idle_gpu_fraction:.0f}% idle (grey, lent to background jobs)",
        pad=12,
    )
    handles = [Patch(color=colour, label=kind.value) for kind, colour in _PHASE_COLOURS.items()]
    handles.append(Patch(color="#E5E5E5", label="idle"))
    axes.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)


def _name_stages(axes: Axes, plan: Plan, phases: list[SchedulePhase]) -> None:
    """Each stage's name on a top axis, over its forward (F) and backward (B) spans."""
    spans: list[tuple[float, str]] = []
    for index, stage in enumerate(stages(plan), start=1):
        names = {layer.name for layer in stage.layers}
        label = stage.first.name if len(stage.layers) == 1 else f"{stage.first.name}…{stage.last.name}"
        for kind, mark in ((PhaseKind.FORWARD, "F"), (PhaseKind.BACKWARD, "B")):
            mine = [phase for phase in phases if phase.kind is kind and phase.layer in names]
            if mine:
                middle = (min(p.start_ms for p in mine) + max(p.end_ms for p in mine)) / 2
                gpus = f"{stage.gpus} GPU" + ("s" if stage.gpus > 1 else "")
                spans.append((middle, f"{mark}{index} {label} ({gpus})"))
    spans = _merge_close(sorted(spans), gap=plan.predicted.iteration_ms * 0.03)
    top = axes.secondary_xaxis("top")
    top.set_xticks([middle for middle, _ in spans], labels=[text for _, text in spans], rotation=20,
                   ha="left", fontsize="x-small")


def _merge_close(spans: list[tuple[float, str]], *, gap: float) -> list[tuple[float, str]]:
    """Labels closer than ``gap`` share one tick, so short stages never print over each other."""
    merged: list[tuple[float, str]] = []
    for middle, text in spans:
        if merged and middle - merged[-1][0] < gap:
            merged[-1] = (merged[-1][0], f"{merged[-1][1]} / {text}")
        else:
            merged.append((middle, text))
    return merged
