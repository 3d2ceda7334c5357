"""Measured times: spans per rank, their medians, and a Chrome/Perfetto trace.

Every op of the program is recorded as a :class:`Span` (compute, communication,
or an idle window as it happened), with the clock injected. Per-stage figures
are medians over the steps after warm-up of the per-step sum of a label's
spans (e.g. all ``reshard:L`` moves of a step).

On a GPU the host runs ahead of the device, so a span is timed with a pair of
device events (:class:`EventClock`, ``torch.cuda.Event(enable_timing=True)``)
recorded on the current stream: nothing waits for the device per op. At the
end of an iteration :meth:`Recorder.settle` waits once for the device and
turns the events into spans on the host clock, placed relative to an event
recorded at the iteration's start.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

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
    cpu_s: float | None = None
    """CPU time this thread spent in the span (host-timed spans, when the recorder has a CPU clock)."""

    @property
    def ms(self) -> float:
        return 1e3 * (self.end_s - self.start_s)

    @property
    def busy_ms(self) -> float:
        """The span's own work: its CPU time where measured (on CPU, waiting for a core is not work), else
        its duration (a device-timed span is the device's time already)."""
        return 1e3 * self.cpu_s if self.cpu_s is not None else self.ms


@dataclass(frozen=True, kw_only=True)
class Counter:
    """Values sampled at one moment (the gradient noise scale after a step...): a counter track in the trace."""

    step: int
    name: str
    at_s: float
    values: dict[str, float]


class DeviceEvent(Protocol):
    def record(self) -> None: ...

    def elapsed_time(self, end: Any) -> float:
        """Milliseconds from this event to ``end`` (both recorded and completed)."""
        ...

    def synchronize(self) -> None: ...


class EventClock(Protocol):
    """Makes device events (``torch.cuda.Event(enable_timing=True)`` on a GPU)."""

    def __call__(self) -> DeviceEvent: ...


@dataclass(frozen=True)
class _Pending:
    step: int
    label: str
    category: Category
    start: DeviceEvent
    end: DeviceEvent


class Recorder:
    """Collects spans: host-timed, or device-timed with ``events`` and settled once per iteration."""

    def __init__(self, clock: Clock, events: EventClock | None = None, cpu_clock: Clock | None = None) -> None:
        """``cpu_clock`` (``time.thread_time`` on CPU) also times host-timed spans in CPU seconds."""
        self.clock = clock
        self._events = events
        self._cpu = cpu_clock
        self._origin: tuple[DeviceEvent, float] | None = None
        self._pending: list[_Pending] = []
        self.spans: list[Span] = []
        self.step = 0
        """The step being run, for spans recorded by code that does not know it (SyncBatchNorm's reductions)."""
        self.counters: list[Counter] = []

    def begin(self, step: int = 0) -> None:
        """Iteration ``step`` starts: the device events' origin is now."""
        self.step = step
        if self._events is not None:
            origin = self._events()
            origin.record()
            self._origin = (origin, self.clock())

    @contextmanager
    def span(self, step: int, label: str, category: Category) -> Iterator[None]:
        if self._events is None:
            start, cpu = self.clock(), self._cpu() if self._cpu is not None else None
            yield
            used = self._cpu() - cpu if self._cpu is not None and cpu is not None else None
            self.spans.append(Span(step=step, label=label, category=category, start_s=start, end_s=self.clock(),
                                   cpu_s=used))
            return
        begin, end = self._events(), self._events()
        begin.record()
        yield
        end.record()
        self._pending.append(_Pending(step, label, category, begin, end))

    def settle(self) -> None:
        """Wait for the device once and turn the iteration's device events into spans."""
        pending, self._pending = self._pending, []
        if self._origin is None or not pending:
            return
        origin, origin_s = self._origin
        pending[-1].end.synchronize()
        for item in pending:
            start_s = origin_s + origin.elapsed_time(item.start) / 1e3
            end_s = origin_s + origin.elapsed_time(item.end) / 1e3
            self.spans.append(Span(step=item.step, label=item.label, category=item.category, start_s=start_s, end_s=end_s))

    def add(self, span: Span) -> None:
        self.spans.append(span)

    def count(self, step: int, name: str, values: dict[str, float]) -> None:
        """Sample counter ``name`` now (host clock)."""
        self.counters.append(Counter(step=step, name=name, at_s=self.clock(), values=values))


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


def chrome_trace(spans: list[Span], *, rank: int, counters: Sequence[Counter] = ()) -> dict[str, Any]:
    """Trace Event Format (chrome://tracing, ui.perfetto.dev): one process per rank; counters as ``"C"``
    events (a value that is not finite is left out)."""
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
    for counter in counters:
        values = {key: value for key, value in counter.values.items() if math.isfinite(value)}
        events.append({"name": counter.name, "ph": "C", "ts": 1e6 * (counter.at_s - origin), "pid": rank,
                       "args": values})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
