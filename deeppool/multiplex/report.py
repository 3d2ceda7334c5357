"""Rendering multiplexing figures for people."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from deeppool.multiplex.metrics import MultiplexReport


def mode_table(reports: Sequence[MultiplexReport], title: str = "multiplexing: foreground alone vs shared (A/B)") -> Table:
    """One row per mode. ``recovered``: the gated modes' share of the idle rank-time turned into work (``-``
    for the free-running modes, which do not work in windows); ``taken from fg``: rank-ms per iteration the
    foreground lost; ``net gain``: against the foreground alone."""
    table = Table(title=title)
    for column in ("mode", "fg alone ms", "fg shared ms", "fg slowdown", "idle rank-ms/it", "bg rank-ms/it",
                   "recovered", "taken from fg rank-ms/it", "bg samples/s", "bg steps", "net gain"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for r in reports:
        recovered = "-" if r.recovered_fraction is None else f"{100 * r.recovered_fraction:.0f}%"
        table.add_row(r.mode, f"{r.fg_alone_ms:.2f}", f"{r.fg_shared_ms:.2f}", f"{100 * r.fg_slowdown:+.1f}%",
                      f"{r.idle_rank_ms_per_iteration:.2f}", f"{r.bg_ms_per_iteration:.2f}", recovered,
                      f"{r.fg_taken_ms_per_iteration:+.2f}", f"{r.bg_samples_per_s:.1f}", str(r.bg_steps),
                      f"{r.net_gain:.3f}x")
    return table


def print_report(report: MultiplexReport, console: Console) -> None:
    console.print(mode_table([report]))
    lines = [
        f"background: {report.bg_steps} steps, {report.bg_samples} samples, busy {report.bg_busy_s:.3f} s; "
        f"idle rank-time {report.idle_rank_ms_per_iteration:.2f} ms per iteration "
        f"({report.alone_steps} alone / {report.shared_steps} shared steps measured)",
    ]
    if report.controller_share is not None:
        lines.append(f"controller: each window's budget ended at {report.controller_share:.2f} of its measured length "
                     f"after {report.controller_backoffs} back-offs")
    if report.bg_loss_first is not None:
        lines.append(f"background loss: first {report.bg_loss_first:.6g}, last {report.bg_loss_last:.6g}")
    lines += [f"error: {error}; the foreground went on" for error in report.bg_errors]
    for line in lines:
        console.print(line, highlight=False, markup=False)
