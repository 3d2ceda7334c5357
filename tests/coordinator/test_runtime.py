"""Jobs as real processes: finish, fail, survive a coordinator restart, never run twice, cancel, requeue, lost."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from deeppool.coordinator.jobs import Job, JobKind, JobRequest, JobStatus
from deeppool.coordinator.launcher import LaunchPhase, LocalLauncher
from deeppool.coordinator.runtime import Runtime
from deeppool.coordinator.store import Store

pytestmark = pytest.mark.slow


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def runtime(tmp_path: Path, steps: list[list[str]]) -> Runtime:
    store = Store(tmp_path / "db.sqlite")
    store.create_token("alice")
    return Runtime(store, LocalLauncher(tmp_path / "jobs"), lambda job, attempt, guests: steps, grace_s=0.5)


def submit(rt: Runtime) -> Job:
    job, _ = rt.store.submit("alice", JobRequest(kind=JobKind.BACKGROUND, model="examples.mlp:model", batch=8))
    return job


def settle(rt: Runtime, job_id: int, done: Callable[[Job], bool], timeout_s: float = 60.0) -> Job:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rt.reconcile()
        job = rt.store.job(job_id)
        if done(job):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} stayed {rt.store.job(job_id).state}")


def says_up(rt: Runtime, job_id: int, attempt: int, *, times: int) -> bool:
    """The job's log has its step's ``up`` line ``times`` times: the process really started."""
    log = rt.launcher.files(job_id, attempt).log
    return log.is_file() and log.read_text().splitlines().count("up") >= times


def test_a_job_runs_its_steps_and_succeeds(tmp_path: Path) -> None:
    rt = runtime(tmp_path, [python("print('first')"), python("print('second')")])
    job = submit(rt)
    assert rt.start(job, "granted")
    assert not rt.start(job, "granted again")  # the claim is a compare-and-swap
    done = settle(rt, job.id, lambda j: j.state.terminal)
    assert done.state is JobStatus.SUCCEEDED and done.exit_code == 0
    log = rt.launcher.files(job.id, 1).log.read_text()
    assert "first" in log and "second" in log
    assert [e.to_state for e in rt.store.events(job.id)] == [JobStatus.PENDING, JobStatus.STARTING,
                                                            JobStatus.RUNNING, JobStatus.SUCCEEDED]


def test_a_job_that_ends_before_the_first_look_still_passes_through_running(tmp_path: Path) -> None:
    rt = runtime(tmp_path, [python("pass")])
    job = submit(rt)
    rt.start(job, "granted")
    while rt.launcher.observe(job.id, 1).phase is not LaunchPhase.EXITED:
        time.sleep(0.01)
    rt.reconcile()
    assert rt.store.job(job.id).state is JobStatus.SUCCEEDED
    assert [e.to_state for e in rt.store.events(job.id)][-2:] == [JobStatus.RUNNING, JobStatus.SUCCEEDED]


def test_a_failing_step_fails_the_job_with_its_code(tmp_path: Path) -> None:
    rt = runtime(tmp_path, [python("import sys; sys.exit(3)"), python("print('never')")])
    job = submit(rt)
    rt.start(job, "granted")
    done = settle(rt, job.id, lambda j: j.state.terminal)
    assert done.state is JobStatus.FAILED and done.exit_code == 3 and "code 3" in done.reason
    assert "never" not in rt.launcher.files(job.id, 1).log.read_text()


def test_a_restarted_coordinator_adopts_running_jobs(tmp_path: Path) -> None:
    rt = runtime(tmp_path, [python("import time; time.sleep(1.5); print('done')")])
    job = submit(rt)
    rt.start(job, "granted")
    settle(rt, job.id, lambda j: j.state is JobStatus.RUNNING)
    rt.store.close()
    restarted = runtime(tmp_path, [python("print('must not run')")])  # a new store and launcher on the same files
    done = settle(restarted, job.id, lambda j: j.state.terminal)
    assert done.state is JobStatus.SUCCEEDED
    log = restarted.launcher.files(job.id, 1).log.read_text()
    assert "done" in log and "must not run" not in log


def test_a_crash_between_commit_and_launch_launches_once(tmp_path: Path) -> None:
    rt = runtime(tmp_path, [python("print('ran')")])
    job = submit(rt)
    assert rt.store.transition(job.id, JobStatus.STARTING, "granted")  # committed, then the coordinator died
    later = datetime.now(UTC) + timedelta(seconds=5)
    rt.reconcile(later)
    rt.reconcile(later)  # a second reconcile before the first supervisor took its lock: a second launch, a no-op
    rt.launcher.launch(job.id, 1, [python("print('ran')")])
    done = settle(rt, job.id, lambda j: j.state.terminal)
    assert done.state is JobStatus.SUCCEEDED
    time.sleep(0.5)
    assert rt.launcher.files(job.id, 1).log.read_text().count("ran\n") == 1


def test_a_job_whose_supervisor_is_killed_is_lost(tmp_path: Path) -> None:
    rt = runtime(tmp_path, [python("import time; time.sleep(60)")])
    job = submit(rt)
    rt.start(job, "granted")
    settle(rt, job.id, lambda j: j.state is JobStatus.RUNNING)
    os.killpg(rt.launcher.files(job.id, 1).supervisor_pid(), signal.SIGKILL)
    done = settle(rt, job.id, lambda j: j.state.terminal)
    assert done.state is JobStatus.FAILED and done.reason.startswith("lost")


def test_cancel_stops_the_processes_and_requeue_runs_the_next_attempt(tmp_path: Path) -> None:
    rt = runtime(tmp_path, [python("import time; print('up', flush=True); time.sleep(60)")])
    job = submit(rt)
    rt.start(job, "granted")
    settle(rt, job.id, lambda j: j.state is JobStatus.RUNNING and says_up(rt, j.id, 1, times=1))
    rt.requeue(rt.store.job(job.id), "preempted by a foreground job")
    assert rt.store.job(job.id).state is JobStatus.PENDING
    assert rt.launcher.observe(job.id, 1).phase is not LaunchPhase.RUNNING
    assert rt.start(rt.store.job(job.id), "granted again")
    assert rt.store.attempts(job.id) == 2
    settle(rt, job.id, lambda j: j.state is JobStatus.RUNNING and says_up(rt, j.id, 2, times=2))
    assert rt.store.transition(job.id, JobStatus.CANCELLED, "cancelled by alice")
    rt.reconcile()
    assert rt.launcher.observe(job.id, 2).phase is not LaunchPhase.RUNNING
    assert rt.launcher.files(job.id, 2).log.read_text().splitlines().count("up") == 2  # both attempts ran, in turn


def test_a_running_jobs_progress_comes_from_its_runs_progress_file(tmp_path: Path) -> None:
    run = tmp_path / "jobs" / "job-1" / "run"  # where the coordinator's driver puts a job's run
    write = ("import json, pathlib, time; run = pathlib.Path({run!r}); run.mkdir(parents=True, exist_ok=True); "
             "(run / 'progress.json').write_text(json.dumps({{'steps_done': 3, 'steps': 10}})); time.sleep(60)")
    rt = runtime(tmp_path, [python(write.format(run=str(run)))])
    job = submit(rt)
    assert job.id == 1 and rt.start(job, "granted")
    assert settle(rt, job.id, lambda j: j.progress > 0).progress == pytest.approx(0.3)
    assert rt.store.transition(job.id, JobStatus.CANCELLED, "cancelled by alice")
    rt.reconcile()


@pytest.mark.heavy
def test_a_straggler_the_run_reports_is_an_event_of_the_job(tmp_path: Path, monkeypatch) -> None:
    """In the heavy tier (15 s): its halves are in the default run, a real run writing its straggler to
    ``events.jsonl`` (``test_an_injected_slow_rank_is_flagged``) and the runtime relaying a run's events
    (``test_hostile_job_files_are_read_defensively_and_events_are_capped``)."""
    from tests.executor.plans import cycle, make_plan

    plan_path = tmp_path / "plan.json"
    make_plan("mlp", global_batch=8, gpus=2, assign=cycle(2)).save(plan_path)
    monkeypatch.setenv("DEEPPOOL_FAULT", "slow-rank:1")  # the supervisor, the run and its ranks inherit it
    out = tmp_path / "jobs" / "job-1" / "run"  # where the coordinator's driver puts a job's run
    rt = runtime(tmp_path, [[sys.executable, "-m", "deeppool.cli", "run", str(plan_path), "--steps", "2500",
                             "--out", str(out)]])  # past the 2 s a rank must stay slow
    job = submit(rt)
    assert job.id == 1 and rt.start(job, "granted")
    done = settle(rt, job.id, lambda j: j.state.terminal, timeout_s=240)
    assert done.state is JobStatus.SUCCEEDED, rt.launcher.files(job.id, 1).log.read_text()[-3000:]
    notes = [e for e in rt.store.events(job.id) if e.from_state is e.to_state]
    assert [e.to_state for e in notes] == [JobStatus.RUNNING]
    assert notes[0].reason.startswith("attempt 1: straggler: rank 1 is a straggler since step")
    assert rt.store.attempts(job.id) == 1
    rt.reconcile()
    assert len(rt.store.events(job.id)) == 5  # submitted, starting, running, the straggler, succeeded: once each
    assert rt.store.job(job.id).progress == 1.0, "rank 0's progress file after the last step"
