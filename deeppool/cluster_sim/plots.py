"""PNG plots of simulated runs: GPU utilisation over time and the JCT CDF."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the non-interactive backend)
import numpy as np  # noqa: E402

from deeppool.cluster_sim.engine import SimResult  # noqa: E402

BINS = 400


def utilisation_series(result: SimResult, bins: int = BINS) -> tuple[np.ndarray, np.ndarray]:
    """Bin centres (s) and mean busy fraction per bin, from the piecewise-constant busy rate."""
    timeline = np.array(result.timeline, dtype=float).reshape(-1, 3)
    end = max(result.makespan_s, 1e-9)
    if timeline.shape[0] < 2:
        return np.array([end / 2]), np.zeros(1)
    times, rates = timeline[:, 0], timeline[:, 1]
    cumulative = np.concatenate([[0.0], np.cumsum(rates[:-1] * np.diff(times))])
    edges = np.linspace(0.0, end, bins + 1)
    busy = np.diff(np.interp(edges, times, cumulative))
    return (edges[:-1] + edges[1:]) / 2, busy / (np.diff(edges) * result.cluster.gpus)


def plot_utilisation(results: Sequence[SimResult], path: Path) -> None:
    figure, axes = plt.subplots(figsize=(9, 4))
    for result in results:
        centres, busy = utilisation_series(result)
        axes.plot(centres / 3600, 100 * busy, label=result.policy, linewidth=1)
    axes.set_xlabel("time (h)")
    axes.set_ylabel("busy GPUs (%)")
    axes.set_ylim(0, 105)
    axes.set_title(f"GPU utilisation over time — {results[0].cluster.describe()}")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def plot_jct_cdf(results: Sequence[SimResult], path: Path) -> None:
    figure, axes = plt.subplots(figsize=(7, 4))
    for result in results:
        jct = np.sort(np.array([r.jct_s for r in result.records])) / 3600
        axes.plot(jct, np.arange(1, jct.size + 1) / max(jct.size, 1), label=result.policy, linewidth=1)
    axes.set_xscale("log")
    axes.set_xlabel("job completion time (h, log scale)")
    axes.set_ylabel("fraction of jobs")
    axes.set_title("JCT CDF")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_plots(results: Sequence[SimResult], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "utilisation.png", out / "jct_cdf.png"]
    plot_utilisation(results, paths[0])
    plot_jct_cdf(results, paths[1])
    return paths
