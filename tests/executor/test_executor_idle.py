"""Idle-window events: one per planned window per step, fired right after the phase it follows."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

import pytest

from deeppool.executor.api import train_rank
from deeppool.executor.config import RunConfig
from deeppool.executor.engine.idle import IdleWindowEvent
from deeppool.executor.engine.program import Program, build_program
from deeppool.executor.engine.timing import Category
from deeppool.model.loading import load_model
from deeppool.model.trace import trace
from tests.executor.fakes import SerialBuilder, ThreadComm, ThreadWorld, run_threads
from tests.executor.plans import Assign, cycle, make_plan

STEPS = 3


def phases_by_label(program: Program) -> dict[str, set[str]]:
    """The plan phases that the ops with each span label cover."""
    covered: dict[str, set[str]] = defaultdict(set)
    for op in program.ops:
        covered[op.label] |= {program.phases[index].label for index in op.phases}
    return covered


@pytest.mark.parametrize("assign", [cycle(1, 4, 2, 3), cycle(1, 1, 4, 4, 4, 2, 2, 3)], ids=["layers", "stages"])
def test_idle_events_fire_after_the_planned_phase_every_step(assign: Assign) -> None:
    plan = make_plan("residual", global_batch=7, gpus=4, assign=assign)
    graph = trace(load_model(plan.model)).graph
    events: dict[int, list[IdleWindowEvent]] = {rank: [] for rank in range(4)}
    closed: dict[int, list[tuple[IdleWindowEvent, float]]] = {rank: [] for rank in range(4)}
    lock = threading.Lock()

    class Listener:
        def opened(self, event: IdleWindowEvent) -> None:
            with lock:
                events[event.rank].append(event)

        def closed(self, event: IdleWindowEvent, closed_at_s: float) -> None:
            with lock:
                closed[event.rank].append((event, closed_at_s))

    listener = Listener()
    builder = SerialBuilder(4)
    results = run_threads(
        ThreadWorld(4),
        lambda comm: train_rank(plan, comm=comm, config=RunConfig(steps=STEPS), builder=builder, on_idle=listener),
    )
    for result in results:
        rank = result.rank
        planned = sorted(plan.idle_windows(rank), key=lambda w: w.start_ms)
        fired = events[rank]
        assert [(e.step, e.window) for e in fired] == [(s, w) for s in range(STEPS) for w in planned]
        assert all(e.expected_ms == e.window.end_ms - e.window.start_ms > 0 for e in fired)
        assert [event for event, _ in closed[rank]] == fired  # every window closes, in order, before the next opens
        idle = [s for s in result.spans if s.category is Category.IDLE]
        assert [(s.start_s, s.end_s) for s in idle] == [(e.opened_at_s, at) for e, at in closed[rank]]
        spans = [s for s in result.spans if s.category in (Category.COMPUTE, Category.COMM)]
        for event in fired:
            step_spans = [s for s in spans if s.step == event.step]
            before = [s for s in step_spans if s.end_s <= event.opened_at_s]
            after = [s for s in step_spans if s.start_s >= event.opened_at_s]
            assert len(before) + len(after) == len(step_spans)  # fired between two ops, never inside one
            if event.window.after is None:
                assert not before
            else:
                last = max(before, key=lambda s: s.end_s).label
                assert event.window.after in phases_by_label(build_program(plan, graph, rank))[last]
            assert event.opened_at_s >= event.iteration_start_s
    assert not events[0]  # rank 0 runs every layer: never idle
    assert all(events[rank] for rank in (1, 2, 3))


def test_idle_windows_appear_in_the_trace() -> None:
    plan = make_plan("mlp", global_batch=6, gpus=2, assign=cycle(2, 1))
    builder = SerialBuilder(2)
    results = run_threads(
        ThreadWorld(2), lambda comm: train_rank(plan, comm=comm, config=RunConfig(steps=2), builder=builder)
    )
    idle = [s for s in results[1].spans if s.category is Category.IDLE]
    assert len(idle) == 2 * len(plan.idle_windows(1))
    assert all(s.end_s >= s.start_s for s in idle)


def test_a_rank_that_runs_no_layer_is_idle_until_rank_0_ends_each_iteration() -> None:
    """With listeners, a wholly idle rank's window is the whole iteration: it closes when rank 0's iteration
    ends (its measured length is the foreground's iteration, not the rank's own empty loop)."""
    plan = make_plan("mlp", global_batch=6, gpus=3, assign=cycle(2))  # rank 2 runs no layer
    closed: list[tuple[IdleWindowEvent, float]] = []
    marks: list[float] = []

    class Listener:
        def opened(self, event: IdleWindowEvent) -> None:
            assert event.rank == 2, "only rank 2 is ever idle"

        def closed(self, event: IdleWindowEvent, closed_at_s: float) -> None:
            closed.append((event, closed_at_s))

    class Marking(ThreadComm):
        def exchange(self, sends, recvs) -> None:
            if self.rank == 0 and [peer for peer, _ in sends] == [2]:
                marks.append(time.perf_counter())
                time.sleep(0.02)  # rank 2's window must stay open while rank 0 is still busy
            super().exchange(sends, recvs)

    world = ThreadWorld(3)
    builder = SerialBuilder(3)
    results = run_threads(world, lambda comm: train_rank(
        plan, comm=Marking(world, comm.rank), config=RunConfig(steps=STEPS), builder=builder, on_idle=Listener()))
    assert [w.after for w in plan.idle_windows(2)] == [None] and not plan.idle_windows(1)
    iterations = [s.start_s for s in results[0].spans if s.category is Category.ITERATION]
    assert [event.step for event, _ in closed] == list(range(STEPS)) and len(marks) == STEPS
    for (event, at), mark, began in zip(closed, marks, iterations, strict=True):
        assert at >= mark + 0.02  # closed by rank 0's mark, not by rank 2's own (empty) iteration
        assert event.opened_at_s <= began + 0.02 or event.step == 0  # opened at the previous mark
