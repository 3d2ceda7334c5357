"""PNG plots of simulated runs: allocation and busy time over time, the JCT CDF, cluster throughput per policy.

Every policy gets its own colour, marker and line style; a curve identical to
an earlier one is drawn offset by a hair and named "= <earlier policy>" in the
legend, so no line hides another.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import cycle
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the non-interactive backend)
import numpy as np  # noqa: E402

from deeppool.cluster_sim.engine import SimResult  # noqa: E402
from deeppool.cluster_sim.metrics import PolicyMetrics  # noqa: E402

BINS = 400
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
STYLES = ("-", "--", "-.", ":")
OFFSET = 0.6
"""Vertical offset (in the plot's units, per repeat) of a curve that coincides with an earlier one."""


def binned(result: SimResult, column: int, bins: int = BINS) -> tuple[np.ndarray, np.ndarray]:
    """Bin centres (s) and the mean of timeline ``column`` (1: busy GPUs, 2: allocated GPUs) per bin, as a fraction."""
    timeline = np.array(result.timeline, dtype=float).reshape(-1, 3)
    end = max(result.makespan_s, 1e-9)
    if timeline.shape[0] < 2:
        return np.array([end / 2]), np.zeros(1)
    times, rates = timeline[:, 0], timeline[:, column]
    cumulative = np.concatenate([[0.0], np.cumsum(rates[:-1] * np.diff(times))])
    edges = np.linspace(0.0, end, bins + 1)
    amount = np.diff(np.interp(edges, times, cumulative))
    return (edges[:-1] + edges[1:]) / 2, amount / (np.diff(edges) * result.cluster.gpus)


def utilisation_series(result: SimResult, bins: int = BINS) -> tuple[np.ndarray, np.ndarray]:
    """Bin centres (s) and mean busy fraction per bin, from the piecewise-constant busy rate."""
    return binned(result, 1, bins)


def _draw(axes, curves: list[tuple[str, np.ndarray, np.ndarray]]) -> None:
    """Plot each (label, x, y) with its own style; a curve equal to an earlier one is offset and named so."""
    looks = zip(cycle(MARKERS), cycle(STYLES), strict=False)
    drawn: list[tuple[str, np.ndarray, np.ndarray]] = []
    for (label, xs, ys), (marker, style) in zip(curves, looks, strict=False):
        twins = [name for name, x0, y0 in drawn if x0.shape == xs.shape and np.allclose(x0, xs) and np.allclose(y0, ys)]
        shown = ys + OFFSET * len(twins)
        name = f"{label} (= {twins[0]}, offset)" if twins else label
        axes.plot(xs, shown, label=name, linestyle=style, marker=marker, markevery=max(1, xs.size // 12),
                  markersize=4, linewidth=1.2)
        drawn.append((label, xs, ys))


def plot_utilisation(results: Sequence[SimResult], path: Path) -> None:
    """Two panels: GPUs allocated to jobs, and GPUs actually busy (allocated minus the Plans' idle time)."""
    figure, (allocated, busy) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True)
    for axes, column, title in ((allocated, 2, "allocated GPUs (%)"), (busy, 1, "busy GPUs (%)")):
        curves = []
        for result in results:
            centres, share = binned(result, column)
            curves.append((result.policy, centres / 3600, 100 * share))
        _draw(axes, curves)
        axes.set_ylabel(title)
        axes.set_ylim(0, 110)
        axes.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    busy.set_xlabel("time (h)")
    allocated.set_title(f"GPU allocation and busy time — {results[0].cluster.describe()}")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_jct_cdf(results: Sequence[SimResult], path: Path) -> None:
    figure, axes = plt.subplots(figsize=(7, 4))
    curves = []
    for result in results:
        jct = np.sort(np.array([r.jct_s for r in result.records])) / 3600
        curves.append((result.policy, jct, 100 * np.arange(1, jct.size + 1) / max(jct.size, 1)))
    _draw(axes, curves)
    axes.set_xscale("log")
    axes.set_xlabel("job completion time (h, log scale)")
    axes.set_ylabel("jobs (%)")
    axes.set_title("JCT CDF")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_throughput(metrics: Sequence[PolicyMetrics], path: Path) -> None:
    """Stacked bars: foreground and background throughput per policy, labelled with the total vs dp."""
    figure, axes = plt.subplots(figsize=(max(5, 1.1 * len(metrics) + 2), 4))
    names = [m.policy for m in metrics]
    fg = np.array([m.fg_throughput for m in metrics])
    bg = np.array([m.bg_throughput for m in metrics])
    axes.bar(names, fg, label="foreground", color="tab:blue")
    axes.bar(names, bg, bottom=fg, label="background", color="tab:orange", hatch="//")
    for index, m in enumerate(metrics):
        ratio = "" if m.cluster_throughput_vs_dp is None else f"{m.cluster_throughput_vs_dp:.2f}x"
        axes.annotate(ratio, (index, fg[index] + bg[index]), ha="center", va="bottom", fontsize=8)
    axes.set_ylabel("throughput (GPUs' worth of dp work)")
    axes.set_title("cluster throughput per policy (label: vs dp)")
    axes.tick_params(axis="x", labelrotation=30)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_plots(results: Sequence[SimResult], metrics: Sequence[PolicyMetrics], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "utilisation.png", out / "jct_cdf.png", out / "throughput.png"]
    plot_utilisation(results, paths[0])
    plot_jct_cdf(results, paths[1])
    plot_throughput(metrics, paths[2])
    return paths
