"""The slowdown feedback controller: AIMD on the share of each idle window that is admitted.

After every shared iteration it compares the foreground's observed iteration
time with its undisturbed time (the alone blocks of the interleaved A/B run):
an EWMA of ``observed / undisturbed`` above ``1 + target`` cuts the admitted
share multiplicatively (``share · decrease``), otherwise the share grows
additively (``share + increase``), within ``[floor, ceiling]``. The share
multiplies each window's expected length to give the background's budget.
This is TCP's rule, as TGS uses it, on DeepPool's EWMA-of-ratio signal.
"""

from __future__ import annotations

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
    smoothing: float = 0.5

    def __post_init__(self) -> None:
        if not 0 < self.floor <= self.start <= self.ceiling:
            raise DeeppoolError(f"controller share bounds must satisfy 0 < floor <= start <= ceiling: {self}")
        if not 0 < self.decrease < 1 or self.increase <= 0 or not 0 < self.smoothing <= 1 or self.target <= 0:
            raise DeeppoolError(f"controller steps out of range: {self}")


class SlowdownController:
    """Pure state machine: feed it iteration times, read :attr:`share`."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.share = config.start
        self.ratio: float | None = None
        self.backoffs = 0

    def observe(self, observed_ms: float, undisturbed_ms: float) -> float:
        """One shared iteration's time against the undisturbed one; returns the new share."""
        if undisturbed_ms <= 0:
            return self.share
        c = self.config
        ratio = observed_ms / undisturbed_ms
        self.ratio = ratio if self.ratio is None else c.smoothing * ratio + (1 - c.smoothing) * self.ratio
        if self.ratio > 1 + c.target:
            self.share = max(c.floor, self.share * c.decrease)
            self.backoffs += 1
        else:
            self.share = min(c.ceiling, self.share + c.increase)
        return self.share
