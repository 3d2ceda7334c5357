"""The listener: A/B blocks, tokens only in shared steps, deadlines from the controller, metrics."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from deeppool.errors import DeeppoolError
from deeppool.executor.engine.idle import IdleWindowEvent
from deeppool.executor.engine.timing import Category, Span
from deeppool.multiplex import child
from deeppool.multiplex.config import ABSchedule, BackgroundConfig, MuxMode
from deeppool.multiplex.job import Piece
from deeppool.multiplex.metrics import RankBackground, RankSteps, efficiency_curve, report
from deeppool.multiplex.session import Session
from deeppool.plans import IdleWindow

WINDOW = IdleWindow(rank=1, start_ms=0.0, end_ms=0.5, after="forward:a")


class FakeBackground:
    def __init__(self) -> None:
        self.tokens: list[tuple[int, float, float]] = []
        self.overruns: list[bool] = []
        self.closes: list[tuple[int, float]] = []
        self.switches: list[tuple[int, bool]] = []
        self.budgets_ms: list[float] = []
        self.step = 0
        self.opened_at_s = 0.0

    def admit(self, deadline_s: float, window_ms: float, *, overrun: bool = False) -> None:
        self.tokens.append((self.step, deadline_s, window_ms))
        self.overruns.append(overrun)
        self.budgets_ms.append(1e3 * (deadline_s - self.opened_at_s))

    def close(self, window_ms: float) -> None:
        self.closes.append((self.step, window_ms))

    def running(self, on: bool) -> None:
        self.switches.append((self.step, on))

    def wait_ready(self, timeout_s: float) -> None:
        del timeout_s

    def stop(self, timeout_s: float = 10.0) -> RankBackground:
        raise AssertionError("not used")


def drive(mode: MuxMode, iteration_ms, steps: int = 19, window_ms=lambda step: 4.0,
          idle_throughout: bool = False) -> tuple[Session, FakeBackground]:
    fake = FakeBackground()
    config = BackgroundConfig(model=Path("bg.py"), mode=mode, schedule=ABSchedule(warmup=3, block=4))
    session = Session(config, fake, predicted_iteration_ms=1.0, idle_throughout=idle_throughout)
    start = 0.0
    for step in range(steps):
        fake.step = step
        event = IdleWindowEvent(rank=1, step=step, window=WINDOW, opened_at_s=start + 1e-3, iteration_start_s=start)
        fake.opened_at_s = event.opened_at_s
        session.opened(event)
        session.closed(event, event.opened_at_s + window_ms(step) / 1e3)
        start += iteration_ms(step) / 1e3
    return session, fake


def test_schedule_alternates_blocks_after_warmup() -> None:
    s = ABSchedule(warmup=2, block=3)
    assert [s.shared(i) for i in range(11)] == [False] * 5 + [True] * 3 + [False] * 3
    assert [s.measured(i) for i in range(8)] == [False, False, False, True, True, False, True, True]


def test_gate_admits_only_in_shared_steps_with_measured_windows() -> None:
    session, fake = drive(MuxMode.GATE, lambda step: 10.0, window_ms=lambda step: 3.0 + (step % 2))
    schedule = session.config.schedule
    shared = [s for s in range(19) if schedule.shared(s)]
    assert [step for step, _, _ in fake.tokens] == shared
    assert [step for step, _ in fake.closes] == shared  # every admitted window is closed, at its measured length
    assert [ms for _, ms in fake.closes] == [pytest.approx(3.0 + s % 2) if schedule.measured(s) else None
                                             for s in shared]  # a transition step's window is no sample
    step, deadline, window_ms = fake.tokens[0]
    assert window_ms == pytest.approx(3.5)  # the median of this window in the alone steps 1..6, not 0.5 x 10
    assert fake.switches == []


def test_only_a_rank_that_runs_no_layer_lets_its_last_piece_overrun_the_deadline() -> None:
    _, busy = drive(MuxMode.GATE, lambda step: 10.0)
    _, idle = drive(MuxMode.GATE, lambda step: 10.0, idle_throughout=True)
    assert busy.overruns and not any(busy.overruns)
    assert idle.overruns and all(idle.overruns) and idle.tokens == busy.tokens


def test_gate_falls_back_to_the_rescaled_plan_before_any_window_is_measured() -> None:
    fake = FakeBackground()
    config = BackgroundConfig(model=Path("bg.py"), mode=MuxMode.GATE, schedule=ABSchedule(warmup=1, block=2))
    session = Session(config, fake, predicted_iteration_ms=1.0)
    session.alone_ms = [10.0]
    event = IdleWindowEvent(rank=1, step=3, window=WINDOW, opened_at_s=1.0, iteration_start_s=1.0)
    assert session.expected_ms(event) == pytest.approx(5.0)  # 0.5 planned ms x (10 measured / 1 predicted)


def test_windows_shorter_than_the_minimum_are_not_lent() -> None:
    _, fake = drive(MuxMode.GATE, lambda step: 10.0, window_ms=lambda step: 0.5)
    assert fake.tokens == [] and fake.closes == []


def test_controller_backs_off_when_shared_steps_are_slow() -> None:
    session, fake = drive(MuxMode.GATE, lambda step: 20.0 if session_shared(step) else 10.0, steps=27)
    assert session.controller.backoffs == 2 and session.controller.share == pytest.approx(0.36)
    assert fake.budgets_ms[0] == pytest.approx(4.0) and fake.budgets_ms[-1] == pytest.approx(0.36 * 4.0)


def session_shared(step: int) -> bool:
    return ABSchedule(warmup=3, block=4).shared(step)


def test_free_modes_switch_at_block_boundaries() -> None:
    _, fake = drive(MuxMode.SCHED_IDLE, lambda step: 10.0)
    assert fake.switches == [(7, True), (11, False), (15, True)]
    assert fake.tokens == []


def _bg(busy_s: float, windows=()) -> RankBackground:
    return RankBackground(rank=1, pid=1, exit_code=0, start_step=0, steps=5, samples=40, busy_s=busy_s, tokens=1,
                          dropped_tokens=0, losses=(2.0, 1.0), spans=(), windows=tuple(windows), error=None)


def _ranks(schedule: ABSchedule, background: RankBackground) -> list[RankSteps]:
    iterations = {s: (11.0 if schedule.shared(s) else 10.0) for s in range(9)}
    rank0 = RankSteps(rank=0, iteration_ms=iterations, idle_ms={}, background=None)
    return [rank0, RankSteps(rank=1, iteration_ms=iterations, idle_ms={s: 4.0 for s in range(9)},
                             background=background)]


def test_a_gated_report_counts_work_in_windows_up_to_each_windows_length() -> None:
    schedule = ABSchedule(warmup=1, block=2)
    shared = [s for s in range(9) if schedule.shared(s) and schedule.measured(s)]
    assert shared == [4, 8]
    # one window half used; the other's work overran it (a micro-step cut by the close, resumed later)
    background = _bg(0.012, windows=[(4.0, 3.0), (4.0, 9.0)])
    r = report(MuxMode.GATE, schedule, _ranks(schedule, background), planned_idle_ms=0.1)
    assert r.fg_slowdown == pytest.approx(0.1)
    assert r.recovered_fraction == pytest.approx((3.0 + 4.0) / (4.0 * 2))  # never above 1
    assert r.bg_ms_per_iteration == pytest.approx(3.5)
    assert r.fg_taken_ms_per_iteration == pytest.approx((2 * 10 - 4) * 0.1)
    assert r.bg_samples_per_s == pytest.approx(40 / (11e-3 * 4))
    assert r.net_gain == pytest.approx(((16 + 3.5) / 11) / (16 / 10))


def test_a_free_running_report_has_no_recovered_share_but_the_time_taken_from_the_foreground() -> None:
    schedule = ABSchedule(warmup=1, block=2)
    r = report(MuxMode.SCHED_IDLE, schedule, _ranks(schedule, _bg(0.400)), planned_idle_ms=0.1)
    assert r.recovered_fraction is None  # 400 ms of work against 16 ms of idle rank-time: not a share of it
    assert r.bg_ms_per_iteration == pytest.approx(400 / 4)
    assert r.fg_taken_ms_per_iteration == pytest.approx(16 * 0.1)
    assert r.net_gain == pytest.approx(((16 + 100) / 11) / (16 / 10))


def test_impossible_figures_are_refused() -> None:
    schedule = ABSchedule(warmup=1, block=2)
    good = report(MuxMode.GATE, schedule, _ranks(schedule, _bg(0.0)), planned_idle_ms=0.1)
    with pytest.raises(DeeppoolError, match=r"recovered 297% of the idle rank-time is outside \[0, 100%\]"):
        dataclasses.replace(good, recovered_fraction=2.97)
    with pytest.raises(DeeppoolError, match="runs freely, so a recovered share"):
        dataclasses.replace(good, mode="sched_idle")
    with pytest.raises(DeeppoolError, match="window efficiency"):
        dataclasses.replace(good, efficiency_by_window_ms=((4.0, 1.5),))


def test_rank_steps_and_efficiency_curve() -> None:
    spans = [Span(step=0, label="iteration", category=Category.ITERATION, start_s=0, end_s=0.01),
             Span(step=0, label="idle", category=Category.IDLE, start_s=0, end_s=0.002),
             Span(step=0, label="idle", category=Category.IDLE, start_s=0.003, end_s=0.004)]
    steps = RankSteps.of(1, spans, None)
    assert steps.iteration_ms[0] == pytest.approx(10.0) and steps.idle_ms[0] == pytest.approx(3.0)
    assert efficiency_curve([(1.5, 0.75), (1.2, 0.6), (5.0, 4.0)]) == ((1.0, pytest.approx(0.5)), (4.0, 0.8))
    # a window's work counts up to its length (a micro-step cut by the close finished in the next window)
    assert efficiency_curve([(5.0, 4.0), (6.0, 9.0)]) == ((4.0, pytest.approx(10.0 / 11.0)),)


class _Clock:
    """``time`` for the child's worker: micro-steps advance it by their rows' cost, nothing else does."""

    def __init__(self) -> None:
        self.now = 100.0

    def perf_counter(self) -> float:
        return self.now

    def process_time(self) -> float:
        return self.now


class _RowsJob:
    """A background job whose micro-step costs 10 ms a row on the fake clock."""

    def __init__(self, clock: _Clock) -> None:
        self.clock, self.step, self.pieces = clock, 0, []

    def micro_step(self, rows):
        self.clock.now += 0.010 * rows
        self.pieces.append(rows)
        return Piece(rows=rows, seconds=0.010 * rows, stepped=False, loss=None)


@pytest.mark.parametrize("overrun", [False, True])
def test_the_childs_last_micro_step_overruns_only_when_told(monkeypatch, overrun) -> None:
    """25 ms to the deadline at 10 ms a row: two rows fit; with ``overrun`` one more row starts before it."""
    clock = _Clock()
    monkeypatch.setattr(child, "time", clock)
    job = _RowsJob(clock)
    worker = child.Worker(job, child.Stats(pid=0), every=1000)
    worker.per_row_s = 0.010
    read, write = os.pipe()
    try:
        worker.window(clock.now + 0.025, child.Lines(read), overrun=overrun)
    finally:
        os.close(read)
        os.close(write)
    assert job.pieces == ([2, 1] if overrun else [2])
    if overrun:  # stopping at the deadline says nothing about the rows' cost (the gate shrinks it: 0.9x)
        assert worker.per_row_s == pytest.approx(0.010)
