"""Rendering a :class:`RunSummary` for people: rich tables and the check line."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from deeppool.executor.training.summary import RunSummary
from deeppool.planner.profiling.netprobe import NetworkFit


def _ratio(measured: float, predicted: float) -> str:
    return f"{measured / predicted:.2f}" if predicted > 0 else "-"


def stage_table(summary: RunSummary, *, limit: int = 40) -> Table:
    """Measured vs predicted per-stage ms, in stage order (beyond ``limit`` stages, those with the most time)."""
    table = Table(title="per-stage time, ms (measured = median, slowest rank of the stage), in stage order")
    for column in ("stage", "layers", "gpus", "fwd pred", "fwd meas", "bwd pred", "bwd meas", "AR pred", "AR meas",
                   "meas/pred"):
        table.add_column(column, justify="left" if column == "stage" else "right")
    rows = list(summary.stages)
    heaviest = sorted(rows, key=lambda s: s.fwd_predicted + s.bwd_predicted + s.allreduce_predicted, reverse=True)
    shown = {id(stage) for stage in heaviest[:limit]}
    for stage in (stage for stage in rows if id(stage) in shown):
        predicted = stage.fwd_predicted + stage.bwd_predicted
        measured = stage.fwd_measured + stage.bwd_measured
        table.add_row(
            stage.name, str(len(stage.layers)), str(stage.gpus),
            f"{stage.fwd_predicted:.3f}", f"{stage.fwd_measured:.3f}",
            f"{stage.bwd_predicted:.3f}", f"{stage.bwd_measured:.3f}",
            f"{stage.allreduce_predicted:.3f}",
            "-" if stage.allreduce_measured is None else f"{stage.allreduce_measured:.3f}",
            _ratio(measured, predicted),
        )
    if len(rows) > limit:
        table.caption = f"the {limit} stages with the most predicted time; {len(rows) - limit} more in summary.json"
    return table


def summary_lines(summary: RunSummary) -> list[str]:
    lines = [
        f"steps: {summary.steps} ({summary.measured_steps} measured after warm-up) on {summary.gpus} ranks, "
        f"global batch {summary.global_batch}",
        f"iteration: measured {summary.iteration_measured_ms:.3f} ms, predicted {summary.iteration_predicted_ms:.3f} ms "
        f"(measured/predicted {_ratio(summary.iteration_measured_ms, summary.iteration_predicted_ms)})",
        f"throughput: {summary.iterations_per_s:.2f} iterations/s, {summary.samples_per_s:.1f} samples/s",
    ]
    if summary.losses:
        lines.append(f"loss: first {summary.losses[0]:.6g}, last {summary.losses[-1]:.6g}")
    adaptation = summary.adapted
    if adaptation is not None:
        lines += [f"straggler: {straggler.describe()}" for straggler in adaptation.stragglers]
        if adaptation.actions:
            lines.append(f"policy: {len(adaptation.actions)} action(s); accumulate {adaptation.accumulate}, "
                         f"learning rate {adaptation.lr:g} at the end")
    lines += adaptation_lines(summary)
    if summary.precision != "fp32":
        lines.append(f"precision: {summary.precision} (autocast; weights and optimizer fp32)")
    if summary.data is not None:
        data = summary.data
        epoch, batch = divmod(data.batches_trained, data.batches_per_epoch)
        lines.append(f"data: {data.batches_trained} global batches of {data.samples} samples "
                     f"({data.epochs:.2f} epochs; next: epoch {epoch}, batch {batch})")
    if summary.check is not None:
        check = summary.check
        lines.append(check.line())
        lines.append(
            f"  bound {check.bound:g}; by kind: gradient {check.gradient:.3e}, buffer {check.buffer:.3e}, "
            f"parameter {check.parameter:.3e}"
        )
    return lines


def adaptation_lines(summary: RunSummary) -> list[str]:
    """The noise scale (``--monitor gns``) and AdaScale's progress, when measured."""
    lines = []
    stats = summary.adaptation.get("gns_stats")
    if stats is not None:
        lines.append(f"gradient noise scale: {_figure(stats['noise_scale'])} samples (moving averages: "
                     f"|G|^2 {_figure(stats['grad_sq_ema'])}, tr(Sigma) {_figure(stats['trace_ema'])}; "
                     f"{stats['groups']} layer group(s), {stats['skipped']} one-GPU layer(s) left out)")
    ada = summary.adaptation.get("adascale")
    if ada is not None:
        lines.append(f"AdaScale: tau {ada['tau']:.4g} scale-invariant steps at scale {ada['scale']:.3g} "
                     f"(base batch {ada['base_batch']}), last gain {ada['gain']:.3g}")
    return lines


def _figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"


def print_summary(summary: RunSummary, console: Console) -> None:
    console.print(stage_table(summary))
    for line in summary_lines(summary):
        console.print(line, highlight=False, markup=False)


def fit_table(fitted: NetworkFit) -> Table:
    """Each measured pattern next to the cost model's time with the fitted figures."""
    table = Table(title="network probe: mean time, measured vs the fitted cost model")
    for column in ("pattern", "ranks", "bytes", "measured ms", "model ms", "model/measured"):
        table.add_column(column, justify="left" if column == "pattern" else "right")
    for sample in fitted.samples:
        predicted = fitted.predict(sample)
        table.add_row(
            sample.pattern.value, str(sample.ranks), f"{sample.nbytes:,}", f"{sample.seconds * 1e3:.3f}",
            f"{predicted * 1e3:.3f}", _ratio(predicted, sample.seconds),
        )
    return table
