"""Rendering a :class:`RunSummary` for people: rich tables and the check line."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from deeppool.executor.netprobe import NetworkFit
from deeppool.executor.summary import RunSummary


def _ratio(measured: float, predicted: float) -> str:
    return f"{measured / predicted:.2f}" if predicted > 0 else "-"


def layer_table(summary: RunSummary, *, limit: int = 40) -> Table:
    """Measured vs predicted per-layer ms, in layer order (beyond ``limit`` layers, those with the most time)."""
    table = Table(title="per-layer time, ms (measured = median, slowest rank of the layer), in layer order")
    for column in ("layer", "gpus", "fwd pred", "fwd meas", "bwd pred", "bwd meas", "AR pred", "AR meas", "meas/pred"):
        table.add_column(column, justify="left" if column == "layer" else "right")
    rows = list(summary.layers)
    heaviest = sorted(rows, key=lambda l: l.fwd_predicted + l.bwd_predicted + l.allreduce_predicted, reverse=True)
    shown = {id(layer) for layer in heaviest[:limit]}
    for layer in (layer for layer in rows if id(layer) in shown):
        predicted = layer.fwd_predicted + layer.bwd_predicted
        measured = layer.fwd_measured + layer.bwd_measured
        table.add_row(
            layer.name, str(layer.gpus),
            f"{layer.fwd_predicted:.3f}", f"{layer.fwd_measured:.3f}",
            f"{layer.bwd_predicted:.3f}", f"{layer.bwd_measured:.3f}",
            f"{layer.allreduce_predicted:.3f}",
            "-" if layer.allreduce_measured is None else f"{layer.allreduce_measured:.3f}",
            _ratio(measured, predicted),
        )
    if len(rows) > limit:
        table.caption = f"the {limit} layers with the most predicted time; {len(rows) - limit} more in summary.json"
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
    if summary.check is not None:
        check = summary.check
        lines.append(check.line())
        lines.append(
            f"  bound {check.bound:g}; by kind: gradient {check.gradient:.3e}, buffer {check.buffer:.3e}, "
            f"parameter {check.parameter:.3e}"
        )
    return lines


def print_summary(summary: RunSummary, console: Console) -> None:
    console.print(layer_table(summary))
    for line in summary_lines(summary):
        console.print(line, highlight=False, markup=False)


def fit_table(fitted: NetworkFit) -> Table:
    """Each measured pattern next to the cost model's time with the fitted figures."""
    table = Table(title="network probe: median time, measured vs the fitted cost model")
    for column in ("pattern", "ranks", "bytes", "measured ms", "model ms", "model/measured"):
        table.add_column(column, justify="left" if column == "pattern" else "right")
    for sample in fitted.samples:
        predicted = fitted.predict(sample)
        table.add_row(
            sample.pattern.value, str(sample.ranks), f"{sample.nbytes:,}", f"{sample.seconds * 1e3:.3f}",
            f"{predicted * 1e3:.3f}", _ratio(predicted, sample.seconds),
        )
    return table
