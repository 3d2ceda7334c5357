"""Straggler detection, as in Resource Elasticity (Or et al., MLSys 2020).

Each step, every rank's speed relative to its group is the median compute
time of the group's *other* ranks over its own, ``s_r = median_{j≠r} t_j / t_r``,
smoothed by an EWMA (α = 0.1) of its logarithm, ``S_r ← exp((1 − α)·ln S_r +
α·ln s_r)``, a running geometric mean. Two departures from Resource
Elasticity's plain EWMA of the ratio, both for shared, noisy machines:

* the others' median: with the median over the whole group, a group of two
  would compare each rank with the mean of both, and a rank at half speed
  would sit at 0.75, next to the threshold; against the other rank it is 0.5.
  For large groups the two medians agree;
* the logarithm: a ratio is bounded below by 0 and unbounded above, so in a
  plain EWMA one step in which the *other* ranks were descheduled (``s_r`` = 5,
  say) lifts a half-speed rank's average from 0.5 to 0.95 and restarts its
  sustained period. In logarithms a ratio and its inverse weigh the same, so
  a healthy rank's noise averages to 1 and one outlier moves the mean by a
  factor ``s_r^α`` (1.17 for 5).

A rank whose
smoothed relative speed stays below ``threshold`` (0.8) for ``patience``
consecutive steps, and for at least ``min_slow_ms`` of the steps' wall time
where the caller gives it, is a straggler; it is reported once, with its
figures, and again only after it has recovered and fallen behind anew.

The time floor is for short steps: a machine's own noise has a time scale,
not a step count (a shared core can compute slower for stretches of a fraction
of a second, alternating between ranks, which at millisecond steps is hundreds
of steps), and no action on a straggler (resizing, restarting) pays for a
slowdown shorter than that. The settings and the figures behind them:
``docs/notes/0024-straggler-detector-settings.md``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from deeppool.errors import DeeppoolError


@dataclass(frozen=True, kw_only=True)
class Straggler:
    rank: int
    step: int
    relative_speed: float
    compute_ms: float
    median_ms: float

    def describe(self) -> str:
        return (f"rank {self.rank} is a straggler since step {self.step}: {self.relative_speed:.2f}x the median "
                f"speed ({self.compute_ms:.2f} ms against {self.median_ms:.2f} ms of compute per step)")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(kw_only=True)
class StragglerDetector:
    alpha: float = 0.1
    threshold: float = 0.8
    patience: int = 10
    min_slow_ms: float = 0.0
    """Wall time a rank must stay slow, besides ``patience`` steps (counted only from steps given a time)."""
    speed: dict[int, float] = field(default_factory=dict)
    slow_steps: dict[int, int] = field(default_factory=dict)
    slow_ms: dict[int, float] = field(default_factory=dict)
    flagged: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not 0 < self.alpha <= 1 or not 0 < self.threshold < 1 or self.patience < 1 or self.min_slow_ms < 0:
            raise DeeppoolError(f"straggler detector settings out of range: {self}")

    def observe(self, step: int, compute_ms: Mapping[int, float], step_ms: float = 0.0) -> list[Straggler]:
        """One step's compute time per rank (of one group) and its wall time; the ranks newly found to straggle."""
        times = {r: t for r, t in compute_ms.items() if t > 0}
        if len(times) < 2:
            return []
        found = []
        for rank, ms in times.items():
            median = statistics.median(t for r, t in times.items() if r != rank)
            relative = median / ms
            smoothed = math.exp((1 - self.alpha) * math.log(self.speed.get(rank, 1.0)) + self.alpha * math.log(relative))
            self.speed[rank] = smoothed
            slow = smoothed < self.threshold
            self.slow_steps[rank] = self.slow_steps.get(rank, 0) + 1 if slow else 0
            self.slow_ms[rank] = self.slow_ms.get(rank, 0.0) + step_ms if slow else 0.0
            sustained = self.slow_steps[rank] >= self.patience and self.slow_ms[rank] >= self.min_slow_ms
            if sustained and rank not in self.flagged:
                self.flagged.add(rank)
                found.append(Straggler(rank=rank, step=step, relative_speed=smoothed, compute_ms=ms, median_ms=median))
            elif self.slow_steps[rank] == 0:
                self.flagged.discard(rank)
        return found
