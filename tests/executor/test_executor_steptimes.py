"""The step monitor over an in-process world: what it gathers, batching, and what counts as compute."""

from __future__ import annotations

from deeppool.executor.training.steptimes import StepMonitor
from deeppool.executor.engine.program import build_program
from deeppool.executor.engine.timing import Category, Recorder, Span
from tests.executor.fakes import ThreadComm, ThreadWorld, run_threads
from tests.executor.plans import cycle, make_plan, traced_graph

PLAN = make_plan("mlp", global_batch=8, gpus=4, assign=cycle(4))
STEPS = 80


def spans(rank: int, step: int) -> list[Span]:
    """Rank 3 computes 2 ms a step, the others 1 ms; rank 2 also waits 5 ms inside its forward (a SyncBN sum).
    Steps of 100 ms: the 30 slow steps the executor waits for pass its 2 s floor (``MIN_SLOW_MS``)."""
    stage = build_program(PLAN, traced_graph(PLAN.model.location), rank).stages[0]
    start = 10.0 * step
    work = 0.002 if rank == 3 else 0.001
    wait = 0.005 if rank == 2 else 0.0
    found = [Span(step=step, label=f"forward:{stage.name}", category=Category.COMPUTE, start_s=start,
                  end_s=start + work + wait),
             Span(step=step, label="iteration", category=Category.ITERATION, start_s=start, end_s=start + 0.1)]
    if wait:
        found.append(Span(step=step, label="syncbn:4 ranks", category=Category.COMM, start_s=start + work / 2,
                          end_s=start + work / 2 + wait))
    return found


def monitor(comm: ThreadComm, every: int) -> list[tuple[int, int, tuple[float, ...]]]:
    recorder = Recorder(lambda: 0.0)
    stages = build_program(PLAN, traced_graph(PLAN.model.location), comm.rank).stages
    watch = StepMonitor(PLAN, stages, comm, recorder, every=every)
    found = []
    for step in range(STEPS):
        for span in spans(comm.rank, step):
            recorder.add(span)
        watch.record(step)
        figures = watch.gather(step) if watch.due or step == STEPS - 1 else None
        if figures is not None:
            found += [(s.rank, s.step, figures.compute_ms) for s in figures.found]
    return found


def test_the_slow_rank_is_found_at_the_same_step_however_often_rows_are_gathered() -> None:
    every_step = run_threads(ThreadWorld(4), lambda comm: monitor(comm, 1))
    batched = run_threads(ThreadWorld(4), lambda comm: monitor(comm, 7))
    assert [[(rank, step) for rank, step, _ in mine] for mine in every_step] == [[(3, every_step[0][0][1])]] * 4
    assert [[(rank, step) for rank, step, _ in mine] for mine in batched] == [[(3, every_step[0][0][1])]] * 4
    compute = every_step[0][0][2]  # rank 2's wait inside its forward is communication, not compute
    assert [round(ms, 6) for ms in compute] == [1.0, 1.0, 1.0, 2.0]
