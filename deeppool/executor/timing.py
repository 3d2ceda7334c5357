"""Measured times: spans per rank, their medians, and a Chrome/Perfetto trace.

Every op of the program is recorded as a :class:`Span` (compute, communication,
or an idle window as it happened), with the clock injected. Per-layer figures
are medians over the steps after warm-up of the per-step sum of a label's
spans (e.g. all ``reshard:L`` moves of a step).
"""

from __future__ import annotations

import enum
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

Clock = Callable[[], float]
"""Seconds, monotonic (``time.perf_counter``)."""


class Category(enum.Enum):
    COMPUTE = "compute"
    COMM = "comm"
    IDLE = "idle"
    ITERATION = "iteration"
    BACKGROUND = "background"


_TRACK = {Category.ITERATION: 0, Category.COMPUTE: 1, Category.COMM: 2, Category.IDLE: 3, Category.BACKGROUND: 4}


@dataclass(frozen=True, kw_only=True)
class Span:
    step: int
    label: str
    category: Category
    start_s: float
    end_s: float

    @property
    def ms(self) -> float:
        return 1e3 * (self.end_s - self.start_s)


class Recorder:
    """Collects spans; ``sync`` runs at both ends of a span (e.g. CUDA synchronize)."""

    def __init__(self, clock: Clock, sync: Callable[[], None] = lambda: None) -> None:
        self.clock = clock
        self._sync = sync
        self.spans: list[Span] = []

    @contextmanager
    def span(self, step: int, label: str, category: Category) -> Iterator[None]:
        self._sync()
        start = self.clock()
        yield
        self._sync()
        self.spans.append(Span(step=step, label=label, category=category, start_s=start, end_s=self.clock()))

    def add(self, span: Span) -> None:
        self.spans.append(span)


@dataclass(frozen=True, kw_only=True)
class RankTimes:
    """One rank's medians (ms) over the measured steps."""

    rank: int
    steps: int
    iteration_ms: float
    labels: dict[str, float]

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "steps": self.steps, "iteration_ms": self.iteration_ms, "labels": self.labels}


def summarise(spans: list[Span], *, rank: int, warmup: int) -> RankTimes:
    """Medians over steps >= ``warmup`` (all steps when there are no others)."""
    steps = sorted({s.step for s in spans if s.category is Category.ITERATION})
    measured = [step for step in steps if step >= warmup] or steps
    keep = set(measured)
    per_step: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    iterations = []
    for span in spans:
        if span.step not in keep:
            continue
        if span.category is Category.ITERATION:
            iterations.append(span.ms)
        elif span.category not in (Category.IDLE, Category.BACKGROUND):
            per_step[span.label][span.step] += span.ms
    labels = {label: statistics.median(by_step.values()) for label, by_step in per_step.items()}
    iteration = statistics.median(iterations) if iterations else 0.0
    return RankTimes(rank=rank, steps=len(measured), iteration_ms=iteration, labels=labels)


def chrome_trace(spans: list[Span], *, rank: int) -> dict[str, Any]:
    """Trace Event Format (chrome://tracing, ui.perfetto.dev): one process per rank."""
    origin = min((s.start_s for s in spans), default=0.0)
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}},
    ]
    for category, tid in _TRACK.items():
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": category.value}})
    for span in spans:
        events.append(
            {
                "name": span.label,
                "cat": span.category.value,
                "ph": "X",
                "ts": 1e6 * (span.start_s - origin),
                "dur": 1e6 * (span.end_s - span.start_s),
                "pid": rank,
                "tid": _TRACK[span.category],
                "args": {"step": span.step},
            }
        )
    return {"traceEvents": events, "displayTimeUnit": "ms"}
