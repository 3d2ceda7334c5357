"""The slowdown feedback controller: AIMD on the share of each idle window that is admitted.

After every shared iteration it compares the foreground's observed iteration
time with its undisturbed time (the alone blocks of the interleaved A/B run).
The signal is the median of ``observed / undisturbed`` over the iterations
since the last decrease (at least ``samples`` of them), so one iteration slowed
by something else on the machine does not count as the background's doing.
A signal above ``1 + target`` cuts the admitted share multiplicatively
(``share · decrease``) and starts a fresh set of samples, as TCP waits a round
trip before it cuts again; otherwise the share grows additively (``share +
increase``), within ``[floor, ceiling]``. The share multiplies each window's
expected length to give the background's budget. This is TCP's rule, as TGS
uses it, on DeepPool's ratio of observed to undisturbed iteration time.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from deeppool.errors import DeeppoolError


@dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    target: float = 0.05
    start: float = 1.0
    increase: float = 0.05
    decrease: float = 0.6
    floor: float = 0.05
    ceiling: float = 1.5
    samples: int = 3

    def __post_init__(self) -> None:
        if not 0 < self.floor <= self.start <= self.ceiling:
            raise DeeppoolError(f"controller share bounds must satisfy 0 < floor <= start <= ceiling: {self}")
        if not 0 < self.decrease < 1 or self.increase <= 0 or self.samples < 1 or self.target <= 0:
            raise DeeppoolError(f"controller steps out of range: {self}")


class SlowdownController:
    """Pure state machine: feed it iteration times, read :attr:`share`."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.share = config.start
        self.ratios: list[float] = []
        self.backoffs = 0

    @property
    def ratio(self) -> float | None:
        """The current signal: the median observed / undisturbed ratio since the last decrease."""
        return statistics.median(self.ratios) if self.ratios else None

    def observe(self, observed_ms: float, undisturbed_ms: float) -> float:
        """One shared iteration's time against the undisturbed one; returns the new share."""
        if undisturbed_ms <= 0:
            return self.share
        c = self.config
        self.ratios.append(observed_ms / undisturbed_ms)
        if len(self.ratios) < c.samples:
            return self.share
        if statistics.median(self.ratios) > 1 + c.target:
            self.share = max(c.floor, self.share * c.decrease)
            self.backoffs += 1
            self.ratios = []
        else:
            self.share = min(c.ceiling, self.share + c.increase)
        return self.share
