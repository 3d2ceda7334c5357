"""One layer measured at one batch (:class:`Measured`), and how repeated passes are summarised into it: the
medians of the passes kept (outliers beyond 3 scaled median absolute deviations dropped) and their relative
spread (the scaled median absolute deviation over the median)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Measured:
    """One layer at one batch: median forward and backward ms of the kept runs, their relative spread,
    and the highest load seen while they ran
    (:attr:`~deeppool.planner.profiling.profiler.ProfilerConfig.load`)."""

    fwd_ms: float
    bwd_ms: float
    spread: float
    load: float = 0.0
    reference_ms: float = 0.0
    """The host's reference time around the measurement (:func:`~deeppool.planner.profiling.timing.reference_ms`, the
    mean of the readings before and after); 0: not read."""
    speed_change: float = 0.0
    """How far the reference moved between those readings (a share of the faster)."""


NOISE_FLOOR_MS = 0.05
"""Layers faster than this at a batch are timer noise; the fit's error ignores them."""


def summary(fwd: list[float], bwd: list[float], load: float) -> Measured:
    """Medians of the passes kept (outliers in forward+backward dropped), their spread, the load seen."""
    totals = [f + b for f, b in zip(fwd, bwd, strict=True)]
    kept = _inliers(totals)
    return Measured(fwd_ms=statistics.median(fwd[i] for i in kept), bwd_ms=statistics.median(bwd[i] for i in kept),
                    spread=relative_spread([totals[i] for i in kept]), load=load)


def _inliers(values: list[float]) -> list[int]:
    """Indices of the values within 3 scaled median absolute deviations of the median."""
    median = statistics.median(values)
    mad = 1.4826 * statistics.median(abs(v - median) for v in values)
    if mad == 0:
        return list(range(len(values)))
    return [i for i, v in enumerate(values) if abs(v - median) <= 3 * mad]


def relative_spread(values: list[float]) -> float:
    """The scaled median absolute deviation over the median of ``values`` (a robust relative spread)."""
    median = statistics.median(values)
    mad = 1.4826 * statistics.median(abs(v - median) for v in values)
    return mad / median if median > 0 else 0.0
