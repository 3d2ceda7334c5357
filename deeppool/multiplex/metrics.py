"""What multiplexing measured: foreground slowdown, background progress, recovered idle time, net gain.

Foreground slowdown compares the same plan in the same invocation, interleaved
A/B (:class:`~deeppool.multiplex.config.ABSchedule`): the median iteration of
the measured *shared* steps over the median of the measured *alone* steps,
minus one. The idle rank-time is measured too: the idle spans of every rank
(a rank that runs no layer is idle for its whole iteration, which ends when
rank 0's does), per step.

In the gated modes (``gate``, ``priority``) background work runs only inside
idle windows, and every admitted window is recorded with its measured length
``L_w`` and the background's busy time in it ``b_w``. Then

    recovered = Σ_w min(b_w, L_w) / Σ_{s shared} Σ_r idle_r(s)

over the measured shared steps ``s``: the share of the idle rank-time of the
shared iterations that the background turned into work. Each admitted window
is one of the idle spans in the denominator and counts at most its own
length, so ``0 <= recovered <= 1`` by construction. The free-running modes
(``none``, ``sched_idle``) do not work in windows, so they have no recovered
share (None): they report the background's busy time per iteration and the
*time taken from the foreground*,

    taken = W · slowdown,   W = R·T_a − I

(the foreground's busy rank-time per iteration, stretched by its measured
slowdown; negative when the shared iterations happened to measure faster). The
net gain is useful rank-time per second with the background over without it,
against the foreground alone:

    gain = ((W + B) / T_s) / (W / T_a)

with R ranks, T_a and T_s the alone and shared iteration times, I the idle
rank-time per alone iteration and B the background's work per shared
iteration (gated: the windowed work above; free: its whole busy time).
Figures outside these bounds are refused (:class:`MultiplexReport` raises)
and never written.
"""

from __future__ import annotations

import json
import math
import signal
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deeppool.errors import DeeppoolError
from deeppool.executor.engine.timing import Category, Span
from deeppool.multiplex.config import ABSchedule, MuxMode

MAX_PARSED = 100_000
"""The most items of a list in a guest's statistics line that are taken."""


@dataclass(frozen=True, kw_only=True)
class RankBackground:
    """One hosting rank's background job, as it ended."""

    rank: int
    pid: int
    exit_code: int
    start_step: int
    steps: int
    samples: int
    busy_s: float
    tokens: int
    dropped_tokens: int
    losses: tuple[float, ...]
    spans: tuple[tuple[float, float], ...]
    windows: tuple[tuple[float, float], ...]
    """(measured window ms, background busy ms in it), one per admitted window."""
    error: str | None
    share: float | None = None
    """The slowdown controller's share of each window at the end (gated modes)."""
    backoffs: int = 0

    @classmethod
    def read(cls, rank: int, pid: int, stats: Path, exit_code: int, log: Path | None = None, *,
             closed_ms: Sequence[float | None] = ()) -> RankBackground:
        """The child's statistics; ``closed_ms`` are the admitted windows' measured lengths, in token order
        (None for a window that is not a sample: a transition step's)."""
        try:
            data = json.loads(stats.read_text())
        except (OSError, ValueError):
            data = {}
        error = data.get("error")
        if exit_code != 0 and error is None:
            error = describe_exit(exit_code) + _log_tail(log)
        return cls(
            rank=rank, pid=pid, exit_code=exit_code, start_step=int(data.get("start_step", 0)),
            steps=int(data.get("steps", 0)), samples=int(data.get("samples", 0)),
            busy_s=float(data.get("busy_s", 0.0)), tokens=int(data.get("tokens", 0)),
            dropped_tokens=int(data.get("dropped_tokens", 0)), losses=tuple(data.get("losses", ())),
            spans=tuple(tuple(s) for s in data.get("spans", ())),
            windows=window_samples(closed_ms, data.get("window_busy_ms", ())),
            error=error,
        )

    @classmethod
    def parse(cls, rank: int, pid: int, data: Any, exit_code: int, log: Path | None = None, *,
              closed_ms: Sequence[float | None] = ()) -> RankBackground:
        """Statistics another account's process sent (a coordinator's guest): only what is well formed is
        taken (counts, finite non-negative numbers, pairs of them), the rest is as if nothing was sent."""
        data = data if isinstance(data, dict) else {}

        def number(name: str) -> float:
            value = data.get(name)
            ok = isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1e15
            return float(value) if ok else 0.0

        def numbers(name: str, width: int) -> list[Any]:
            items = data.get(name)
            if not isinstance(items, list):
                return []
            kept = []
            for item in items[:MAX_PARSED]:
                values = item if width > 1 and isinstance(item, list) and len(item) == width else [item]
                if len(values) == width and all(isinstance(v, int | float) and not isinstance(v, bool)
                                                and math.isfinite(v) for v in values):
                    kept.append(tuple(float(v) for v in values) if width > 1 else float(values[0]))
            return kept

        error = data.get("error") if isinstance(data.get("error"), str) else None
        if exit_code != 0 and error is None:
            try:
                error = describe_exit(exit_code)
            except ValueError:  # not a signal's number
                error = f"exited with code {exit_code}"
        return cls(
            rank=rank, pid=pid, exit_code=exit_code, start_step=int(number("start_step")),
            steps=int(number("steps")), samples=int(number("samples")), busy_s=number("busy_s"),
            tokens=int(number("tokens")), dropped_tokens=int(number("dropped_tokens")),
            losses=tuple(numbers("losses", 1)), spans=tuple(numbers("spans", 2)),
            windows=window_samples(closed_ms, busy_ms(data.get("window_busy_ms"))),
            error=None if error is None else error[:500],
        )

    def trace_spans(self) -> list[Span]:
        return [Span(step=-1, label="background", category=Category.BACKGROUND, start_s=a, end_s=b)
                for a, b in self.spans]


def busy_ms(items: Any) -> list[float]:
    """A guest's busy ms per window, one per token in order: anything not a finite, non-negative number is 0
    (dropping it would pair the later windows with the wrong lengths)."""
    if not isinstance(items, list):
        return []
    return [float(v) if isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < 1e15 else 0.0
            for v in items[:MAX_PARSED]]


def window_samples(closed_ms: Sequence[float | None], busy_ms: Sequence[float]) -> tuple[tuple[float, float], ...]:
    """(measured window ms, busy ms) for each admitted window that is a sample."""
    return tuple((length, busy) for length, busy in zip(closed_ms, busy_ms) if length is not None)


def describe_exit(code: int) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        hint = " (out of memory?)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exited with code {code}"


def _log_tail(log: Path | None) -> str:
    if log is None or not log.exists():
        return ""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return f": {lines[-1].strip()}" if lines else ""


@dataclass(frozen=True, kw_only=True)
class RankSteps:
    """What a rank sends to rank 0: per-step iteration and idle ms, and its background (if it hosts one)."""

    rank: int
    iteration_ms: dict[int, float]
    idle_ms: dict[int, float]
    background: RankBackground | None

    @classmethod
    def of(cls, rank: int, spans: Iterable[Span], background: RankBackground | None) -> RankSteps:
        iteration: dict[int, float] = {}
        idle: dict[int, float] = defaultdict(float)
        for span in spans:
            if span.category is Category.ITERATION:
                iteration[span.step] = span.ms
            elif span.category is Category.IDLE:
                idle[span.step] += span.ms
        return cls(rank=rank, iteration_ms=iteration, idle_ms=dict(idle), background=background)


@dataclass(frozen=True, kw_only=True)
class MultiplexReport:
    mode: str
    fg_alone_ms: float
    fg_shared_ms: float
    fg_slowdown: float
    alone_steps: int
    shared_steps: int
    idle_rank_ms_per_iteration: float
    planned_idle_rank_ms_per_iteration: float
    bg_busy_s: float
    bg_steps: int
    bg_samples: int
    bg_samples_per_s: float
    recovered_fraction: float | None
    """Gated modes: the share of the shared iterations' idle rank-time turned into background work, in
    [0, 1]; None in the free-running modes (their work is not measured in windows)."""
    bg_ms_per_iteration: float
    """The background's work per shared iteration in rank-ms (B of the net gain)."""
    fg_taken_ms_per_iteration: float
    """Rank-ms per iteration the foreground lost to the background (its busy rank-time × its slowdown)."""
    net_gain: float
    bg_loss_first: float | None
    bg_loss_last: float | None
    bg_pids: tuple[int, ...]
    bg_errors: tuple[str, ...]
    efficiency_by_window_ms: tuple[tuple[float, float], ...]
    controller_share: float | None = None
    controller_backoffs: int = 0

    def __post_init__(self) -> None:
        problems = impossible(self)
        if problems:
            raise DeeppoolError(f"impossible multiplexing figures ({self.mode}), not written: {'; '.join(problems)}")

    @property
    def gated(self) -> bool:
        return MuxMode(self.mode).gated

    @property
    def fg_iteration_ms(self) -> float:
        return self.fg_shared_ms

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["fg_iteration_ms"] = self.fg_iteration_ms
        data["efficiency_by_window_ms"] = [{"window_ms": w, "efficiency": e} for w, e in self.efficiency_by_window_ms]
        return data


def impossible(r: MultiplexReport) -> list[str]:
    """What no measurement can give: a share outside [0, 1], a share for a free mode, negative times."""
    problems = []
    if r.gated and r.recovered_fraction is None:
        problems.append(f"mode {r.mode} works in windows but has no recovered share")
    if not r.gated and r.recovered_fraction is not None:
        problems.append(f"mode {r.mode} runs freely, so a recovered share of the idle time is not measured")
    if r.recovered_fraction is not None and not 0 <= r.recovered_fraction <= 1 + 1e-9:
        problems.append(f"recovered {100 * r.recovered_fraction:.0f}% of the idle rank-time is outside [0, 100%]")
    if any(not 0 <= e <= 1 + 1e-9 for _, e in r.efficiency_by_window_ms):
        problems.append("a window efficiency is outside [0, 1]")
    times = {"fg_alone_ms": r.fg_alone_ms, "fg_shared_ms": r.fg_shared_ms, "bg_busy_s": r.bg_busy_s,
             "idle_rank_ms_per_iteration": r.idle_rank_ms_per_iteration, "bg_ms_per_iteration": r.bg_ms_per_iteration}
    problems += [f"{name} {value:g} is negative" for name, value in times.items() if value < 0]
    if r.net_gain <= 0 or not math.isfinite(r.net_gain):
        problems.append(f"net gain {r.net_gain:g} is not positive")
    return problems


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def report(
    mode: MuxMode, schedule: ABSchedule, ranks: list[RankSteps], *, planned_idle_ms: float,
) -> MultiplexReport:
    """Rank 0's summary over every rank's steps (rank 0 runs every stage, so its iterations are the run's)."""
    iterations = max(ranks, key=lambda r: len(r.iteration_ms)).iteration_ms
    steps = sorted(iterations)
    alone = [s for s in steps if schedule.measured(s) and not schedule.shared(s)]
    shared = [s for s in steps if schedule.measured(s) and schedule.shared(s)]
    shared_all = [s for s in steps if schedule.shared(s)]
    t_alone = _median([iterations[s] for s in alone])
    t_shared = _median([iterations[s] for s in shared])
    idle = _median([sum(r.idle_ms.get(s, 0.0) for r in ranks) for s in alone])
    hosts = [r.background for r in ranks if r.background is not None]
    busy_s = sum(b.busy_s for b in hosts)
    shared_wall_s = sum(iterations[s] for s in shared_all) / 1e3
    recovered: float | None = None
    bg_ms = 1e3 * busy_s / max(len(shared_all), 1)
    if mode.gated:
        offered = sum(r.idle_ms.get(s, 0.0) for r in ranks for s in shared)
        done = windowed_ms(hosts)
        recovered, bg_ms = (done / offered if offered > 0 else 0.0), done / max(len(shared), 1)
    work = len(ranks) * t_alone - idle
    slowdown = t_shared / t_alone - 1 if t_alone > 0 and t_shared > 0 else 0.0
    losses = [b.losses for b in hosts if b.losses]
    return MultiplexReport(
        mode=mode.value, fg_alone_ms=t_alone, fg_shared_ms=t_shared, fg_slowdown=slowdown,
        alone_steps=len(alone), shared_steps=len(shared), idle_rank_ms_per_iteration=idle,
        planned_idle_rank_ms_per_iteration=planned_idle_ms, bg_busy_s=busy_s,
        bg_steps=sum(b.steps for b in hosts), bg_samples=sum(b.samples for b in hosts),
        bg_samples_per_s=sum(b.samples for b in hosts) / shared_wall_s if shared_wall_s > 0 else 0.0,
        recovered_fraction=recovered, bg_ms_per_iteration=bg_ms, fg_taken_ms_per_iteration=max(work, 0.0) * slowdown,
        net_gain=net_gain(len(ranks), t_alone, t_shared, idle, bg_ms),
        bg_loss_first=losses[0][0] if losses else None, bg_loss_last=losses[0][-1] if losses else None,
        bg_pids=tuple(b.pid for b in hosts),
        bg_errors=tuple(f"rank {b.rank}: background {b.error}" for b in hosts if b.error),
        efficiency_by_window_ms=efficiency_curve([w for b in hosts for w in b.windows]),
        controller_share=min((b.share for b in hosts if b.share is not None), default=None),
        controller_backoffs=sum(b.backoffs for b in hosts),
    )


def windowed_ms(hosts: list[RankBackground]) -> float:
    """The background's work in the admitted windows that are samples, each counted up to its length."""
    return sum(min(busy, length) for b in hosts for length, busy in b.windows)


def net_gain(ranks: int, t_alone: float, t_shared: float, idle: float, bg_per_iteration: float) -> float:
    """Useful rank-time per second with the background over without it (see the module docstring)."""
    work = ranks * t_alone - idle
    if work <= 0 or t_shared <= 0 or t_alone <= 0:
        return 1.0
    return ((work + bg_per_iteration) / t_shared) / (work / t_alone)


def efficiency_curve(windows: list[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """Busy over offered window time, in power-of-two bins of window length (ms; bin = its lower edge); each
    window's busy time counted up to its length, as in the recovered share."""
    bins: dict[float, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for window_ms, busy_ms in windows:
        if window_ms <= 0:
            continue
        edge = 2.0 ** math.floor(math.log2(window_ms))
        bins[edge][0] += window_ms
        bins[edge][1] += min(busy_ms, window_ms)
    return tuple((edge, busy / offered) for edge, (offered, busy) in sorted(bins.items()) if offered > 0)
