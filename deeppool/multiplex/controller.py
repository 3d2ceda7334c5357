"""The slowdown feedback controller: AIMD on the share of each idle window that is admitted.

After every shared iteration it compares the foreground's observed iteration
time with its undisturbed time (the alone blocks of the interleaved A/B run).
Its signal is the median ``observed / undisturbed`` ratio of the shared
iterations since its last decision (at least ``samples`` of them), so one
iteration slowed by something else on the machine is not blamed on the
background, and each decision sees only iterations run under the previous
one (as TCP waits a round trip before it cuts again). A signal above

    1 + target + confidence · 1.2533 · noise / √n

cuts the admitted share multiplicatively (``share · decrease``): ``noise`` is
the relative spread (robust standard deviation) of one undisturbed iteration,
so ``1.2533 · noise / √n`` is the standard error of the median of ``n``. On a
quiet machine that margin vanishes; on a noisy one the controller waits for
more iterations instead of chasing noise. A signal below ``1 + target / 2``
grows the share additively (``share + increase``). In between it holds and
keeps sampling, up to ``max_samples``. The share stays in ``[floor, ceiling]``. The share multiplies each window's
expected length to give the background's budget. This is TCP's rule, as TGS
uses it, on DeepPool's ratio of observed to undisturbed iteration time.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from deeppool.errors import DeeppoolError

MEDIAN_ERROR = 1.2533  # standard error of a median over that of a mean, for normal noise


@dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    target: float = 0.05
    start: float = 1.0
    increase: float = 0.05
    decrease: float = 0.6
    floor: float = 0.05
    ceiling: float = 1.5
    samples: int = 3
    max_samples: int = 24
    confidence: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.floor <= self.start <= self.ceiling:
            raise DeeppoolError(f"controller share bounds must satisfy 0 < floor <= start <= ceiling: {self}")
        if not 0 < self.decrease < 1 or self.increase <= 0 or not 1 <= self.samples <= self.max_samples \
                or self.target <= 0 or self.confidence < 0:
            raise DeeppoolError(f"controller steps out of range: {self}")


class SlowdownController:
    """Pure state machine: feed it iteration times, read :attr:`share`."""

    def __init__(self, config: ControllerConfig) -> None:
        self.config = config
        self.share = config.start
        self.ratios: list[float] = []
        self.backoffs = 0

    def observe(self, observed_ms: float, undisturbed_ms: float, noise: float = 0.0) -> float:
        """One shared iteration's time against the undisturbed one (and its relative noise); the new share."""
        if undisturbed_ms <= 0:
            return self.share
        c = self.config
        self.ratios.append(observed_ms / undisturbed_ms)
        n = len(self.ratios)
        if n < c.samples:
            return self.share
        signal = statistics.median(self.ratios)
        if signal > 1 + c.target + c.confidence * MEDIAN_ERROR * noise / math.sqrt(n):
            self.share = max(c.floor, self.share * c.decrease)
            self.backoffs += 1
        elif signal < 1 + c.target / 2:
            self.share = min(c.ceiling, self.share + c.increase)
        elif n < c.max_samples:
            return self.share
        self.ratios = []
        return self.share


def relative_noise(samples: list[float]) -> float:
    """Robust standard deviation of ``samples`` over their median (1.4826 · MAD / median); 0 for fewer than 4."""
    if len(samples) < 4:
        return 0.0
    middle = statistics.median(samples)
    if middle <= 0:
        return 0.0
    return 1.4826 * statistics.median(abs(x - middle) for x in samples) / middle
