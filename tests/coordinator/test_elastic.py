"""Elastic jobs in the coordinator: resizes from checkpoints on real processes, and what the policy is told.

The resize tests run the coordinator's real runtime, launcher, driver and planner in-process (a real
database, real supervisors, real ``torch.distributed`` ranks); the policy is a scripted one that resizes a
job once it has made progress, so the moment of the resize is the run's, not a timer's.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sqlite3
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import pytest

from deeppool.adaptation.goodput import IterationFit, adascale_gain
from deeppool.coordinator.client import Client
from deeppool.coordinator.driver import DriverSteps
from deeppool.coordinator.elastic import Elastic, ResizePhase, converted_steps
from deeppool.coordinator.jobs import JobKind, JobRequest, JobStatus, SpeedPoint
from deeppool.coordinator.launcher import LocalLauncher
from deeppool.coordinator.live_policy import live_policy
from deeppool.coordinator.metrics import exposition
from deeppool.coordinator.page import by_job, render
from deeppool.coordinator.runtime import Runtime
from deeppool.coordinator.service import Service, snapshot
from deeppool.coordinator.speeds import measured, speed_model
from deeppool.coordinator.store import Store
from deeppool.errors import DeeppoolError
from deeppool.scheduling import POLICIES, PolluxPolicy
from deeppool.scheduling.scripted import ScriptedResizes
from tests.coordinator.accounts import job_folder
from tests.coordinator.test_durability import start
from tests.net import free_port

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "tests" / "coordinator" / "models" / "burst_cnn.py"


@dataclass
class Cluster:
    store: Store
    folder: Path
    service: Service

    @classmethod
    def make(cls, root: Path, policy: object, gpus: int) -> Cluster:
        store = Store(root / "deeppool.db")
        folder = root / "jobs"
        runtime = Runtime(store, LocalLauncher(folder, cgroups=False),
                          DriverSteps(folder=folder, elastic=True, allowed_roots=(REPO,)), grace_s=30)
        return cls(store=store, folder=folder, service=Service(runtime, policy, gpus, elastic=Elastic(runtime, gpus)))

    def run_until(self, done, timeout_s: float = 400.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.service.tick()
            if done():
                return
            time.sleep(0.3)
        raise AssertionError(f"timed out: {[(j.id, j.state, j.reason) for j in self.store.jobs()]}")

    def losses(self, job_id: int) -> dict[int, float]:
        """Step -> global mean loss of the job's last attempt (``run/steps.jsonl``)."""
        lines = (self.folder / f"job-{job_id}" / "run" / "steps.jsonl").read_text().splitlines()
        return {record["step"]: record["loss"] for record in map(json.loads, lines)}


def _submit(store: Store, gpus: int, steps: int) -> int:
    job, _ = store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model=str(MODEL), gpus=gpus, batch=64,
                                              steps=steps, amplification=1.5))
    return job.id


@pytest.mark.heavy
def test_a_job_resized_2_to_1_to_2_continues_the_loss_of_an_unresized_run_and_reuses_its_plan(
        tmp_path: Path) -> None:
    store = Store(tmp_path / "deeppool.db")
    store.create_token("alice")
    elastic, reference = _submit(store, 2, 120), _submit(store, 1, 120)  # both resizes land before its end
    store.close()
    cluster = Cluster.make(tmp_path, ScriptedResizes(job_id=elastic, widths=[1, 2]), gpus=3)
    cluster.run_until(lambda: all(cluster.store.job(j).state.terminal for j in (elastic, reference)))
    job, events = cluster.store.job(elastic), [e.reason for e in cluster.store.events(elastic)]
    assert job.state is JobStatus.SUCCEEDED and job.held == 2, events
    changes = cluster.store.resizes(elastic)
    assert [(c.from_gpus, c.to_gpus, c.phase) for c in changes] == [(2, 1, "DONE"), (1, 2, "DONE")], events
    assert [c.plan_cached for c in changes] == [False, True]  # back on 2 GPUs: the first attempt's plan
    assert all(c.checkpoint_s is not None and c.restart_s is not None for c in changes)
    resumed, unresized = cluster.losses(elastic), cluster.losses(reference)
    assert min(resumed) == changes[-1].steps_done  # steps are 0-based: the first after the checkpoint
    for step, loss in resumed.items():
        assert math.isclose(loss, unresized[step], rel_tol=1e-5), (step, loss, unresized[step])


@pytest.mark.heavy
def test_a_server_lost_mid_resize_leaves_a_job_the_next_one_resumes(tmp_path: Path) -> None:
    store = Store(tmp_path / "deeppool.db")
    store.create_token("alice")
    job_id = _submit(store, 2, 120)
    store.close()
    first = Cluster.make(tmp_path, ScriptedResizes(job_id=job_id, widths=[1]), gpus=2)
    first.run_until(lambda: bool(first.store.resizes(job_id)))
    first.store.close()  # the server is gone mid-resize: only the database and the processes remain
    second = Cluster.make(tmp_path, POLICIES["fifo-backfill"], gpus=2)
    second.run_until(lambda: second.store.job(job_id).state.terminal)
    job, (change,) = second.store.job(job_id), second.store.resizes(job_id)
    assert job.state is JobStatus.SUCCEEDED and job.held == 1, job
    assert change.phase == ResizePhase.DONE.value and change.steps_done is not None


@pytest.mark.heavy
def test_a_resize_whose_restart_fails_goes_back_to_the_last_good_width_with_no_step_lost(tmp_path: Path) -> None:
    store = Store(tmp_path / "deeppool.db")
    store.create_token("alice")
    job, _ = store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model=str(MODEL), gpus=2, batch=2, steps=300))
    store.close()
    # 3 GPUs for a global batch of 2: the planner refuses the new width, so the new attempt fails before a step
    cluster = Cluster.make(tmp_path, ScriptedResizes(job_id=job.id, widths=[3]), gpus=3)
    cluster.run_until(lambda: cluster.store.job(job.id).state.terminal)
    done, (change,) = cluster.store.job(job.id), cluster.store.resizes(job.id)
    events = [e.reason for e in cluster.store.events(job.id)]
    assert done.state is JobStatus.SUCCEEDED and done.held == 2, events
    assert change.phase == ResizePhase.REVERTED.value
    assert any("back to 2 GPUs from its checkpoint" in reason for reason in events), events
    assert min(cluster.losses(job.id)) == change.steps_done  # the last attempt resumed where the stop left off


@pytest.mark.heavy
def test_pollux_decides_live_and_grows_a_job_when_another_ends(tmp_path: Path) -> None:
    store = Store(tmp_path / "deeppool.db")
    store.create_token("alice")
    long, short = _submit(store, 2, 400), _submit(store, 2, 30)
    store.close()
    # the simulator's policy, deciding every 5 s, with a restart charged as 1 s (the artifact's 30 s would keep
    # jobs this young from ever moving)
    cluster = Cluster.make(tmp_path, PolluxPolicy(interval_s=5.0, restart_delay_s=1.0), gpus=2)
    cluster.run_until(lambda: all(cluster.store.job(j).state.terminal for j in (long, short)), timeout_s=600)
    assert {cluster.store.job(j).state for j in (long, short)} == {JobStatus.SUCCEEDED}
    moves = [(c.from_gpus, c.to_gpus, c.phase) for c in cluster.store.resizes(long)]
    assert (1, 2, "DONE") in moves, [e.reason for e in cluster.store.events(long)]
    assert cluster.store.speeds([long])[long], "its speed was measured"


def _resizes(db: Path) -> list[tuple[int, int, str]]:
    """(from, to, phase) of every resize, read from the database a running server holds (read-only)."""
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
        return [tuple(row) for row in con.execute("SELECT from_gpus, to_gpus, phase FROM resizes ORDER BY id")]


def _wait(what, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


@pytest.mark.heavy
def test_serve_policy_pollux_grows_a_job_and_a_kill_9_mid_resize_leaves_it_to_the_next_server(
        tmp_path: Path) -> None:
    db, port = tmp_path / "deeppool.db", free_port()
    store = Store(db)
    client_token = store.create_token("alice")
    job_id = _submit(store, 2, 100_000)
    store.close()
    logs = job_folder()  # one folder both servers use, which the jobs' account can reach
    server = start(db, port, gpus=2, allow=(REPO,), options=("--policy", "pollux"), logs=logs)
    client = Client(f"http://127.0.0.1:{port}", client_token)
    try:
        # Pollux starts a new job on 1 GPU (at most twice its peak), then, at its next decision, grows it
        _wait(lambda: client.job(job_id).state is JobStatus.RUNNING, 200)
        assert client.job(job_id).held == 1
        _wait(lambda: bool(_resizes(db)), 200)
        os.kill(server.pid, signal.SIGKILL)  # mid-resize: the stop is asked, the job not yet restarted
        server.wait(10)
        assert [(low, high) for low, high, _ in _resizes(db)] == [(1, 2)]
        assert _resizes(db)[0][2] in ("STOPPING", "RESTARTING")
        server = start(db, port, gpus=2, allow=(REPO,), options=("--policy", "pollux"), logs=logs)
        _wait(lambda: _resizes(db)[0][2] not in ("STOPPING", "RESTARTING"), 300)
        assert _resizes(db)[0] == (1, 2, "DONE")
        assert client.job(job_id).held == 2 and client.job(job_id).state is JobStatus.RUNNING
        client.cancel(job_id)
    finally:
        server.terminate()
        server.wait(10)


def test_a_script_job_is_rigid_and_never_resized(tmp_path: Path) -> None:
    store = Store(tmp_path / "deeppool.db")
    store.create_token("alice")
    script, _ = store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model=str(MODEL), gpus=2, batch=64,
                                                 script=str(REPO / "examples" / "hf_user_loop.py")))
    model, _ = store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model=str(MODEL), gpus=2, batch=64))
    folder = tmp_path / "jobs"
    runtime = Runtime(store, LocalLauncher(folder, cgroups=False), DriverSteps(folder=folder, elastic=True))
    elastic = Elastic(runtime, 4)
    view = elastic.view(store.jobs())
    rigid, free = view.speeds[script.id], view.speeds[model.id]
    assert (rigid.min_gpus, rigid.max_gpus) == (2, 2) and (free.min_gpus, free.max_gpus) == (1, 4)
    assert not elastic.resizable(script) and elastic.resizable(model)
    # Pollux, deciding at its interval, gives the rigid job its 2 GPUs or none, never another count
    jobs = store.jobs()
    now = jobs[-1].created_at.replace(microsecond=0)
    decision = PolluxPolicy(interval_s=1.0).decide(snapshot(jobs, 3, now, elastic=view))
    assert {s.job_id: s.gpus for s in decision.start}.get(script.id, 2) == 2
    assert not elastic.resize(script, 1, 64, "a test")  # not running, and not resizable anyway


def test_speeds_are_read_from_a_runs_steps_and_fitted() -> None:
    lines = [{"step": i, "loss": 1.0, "iteration_ms": ms, "samples": 64, "gns": 300.0 if i == 5 else None}
             for i, ms in enumerate([900, 500, 400, 100, 110, 120])]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode() + b'{"step": 6, "iter'  # one being written
    point = measured(data, job_id=1, gpus=2, batch=64)
    assert point == SpeedPoint(job_id=1, gpus=2, batch=64, iteration_s=0.11, steps=3, gns=300.0)
    fit = IterationFit.fit([(2, 64, 0.11), (1, 64, 0.2)])
    assert math.isclose(fit.iteration_s(2, 64), 0.11) and math.isclose(fit.iteration_s(1, 64), 0.2)
    job = _job(gpus=2, batch=64, steps=100)
    speed = speed_model(job, [point, SpeedPoint(job_id=1, gpus=1, batch=64, iteration_s=0.2, steps=3)],
                        total_gpus=4, rigid=False)
    assert speed.batches() == (64, 128, 256, 512)
    assert math.isclose(speed.goodput(2, 128, 0), adascale_gain(128, base_batch=64, noise_scale=300.0)
                        / fit.iteration_s(2, 128))
    assert speed.best_batch(4, 0)[0] > 64  # a larger batch pays on more GPUs at this noise scale


def test_a_batch_change_carries_progress_over_in_steps_at_the_asked_batch() -> None:
    gain = adascale_gain(256, base_batch=64, noise_scale=300.0)  # 4x the batch, worth less than 4 steps
    assert 1 < gain < 4
    # 100 steps asked at 64, 40 done at 64: the 60 left are worth 60 / gain steps at 256, and back
    at_256 = converted_steps(100, 40, from_gain=1.0, to_gain=gain)
    assert at_256 == 40 + math.ceil(60 / gain)
    assert 100 <= converted_steps(at_256, 40, from_gain=gain, to_gain=1.0) <= 100 + math.ceil(gain)  # rounded up
    assert converted_steps(100, 100, from_gain=1.0, to_gain=gain) == 101  # a stop at the end still takes a step


def test_the_page_and_metrics_show_widths_resizes_and_speeds(tmp_path: Path) -> None:
    store = Store(tmp_path / "deeppool.db")
    store.create_token("alice")
    job_id = _submit(store, 2, 10)
    for state in (JobStatus.STARTING, JobStatus.RUNNING):
        store.transition(job_id, state, "a test")
    change = store.begin_resize(store.job(job_id), 1, 64, "a test")
    assert change is not None and store.begin_resize(store.job(job_id), 3, 64, "a test") is None  # one at a time
    store.update_resize(change.id, "RESTARTING", steps_done=4, checkpoint_s=0.25, stop_s=1.0,
                        relaunched_at=change.asked_at + 2, attempt=2)
    store.set_shape(job_id, width=1, batch=64, steps=10, gain=None)
    store.update_resize(change.id, "DONE", plan_s=0.5, plan_cached=True, restart_s=3.0)
    store.record_speed(SpeedPoint(job_id=job_id, gpus=1, batch=64, iteration_s=0.2, steps=7, gns=120.0))
    job = store.job(job_id)
    assert job.held == 1 and job.gpus == 2  # what it runs on now; what it asked for stays
    page = render([job], store.moves([job_id]), 2, resizes=by_job(store.resizes_of([job_id])),
                  speeds=store.speeds([job_id]))
    assert "2&rarr;1 GPUs done, checkpoint 0.2 s, plan 0.5 s, restart 3.0 s (plan cached)" in page
    assert "0.200 s/step on 1 at batch 64, noise scale 120" in page
    counts, last = store.resize_counts()
    text = exposition([job], 2, resizes=counts, last_resize=last, speeds=store.speeds([job_id])).decode()
    for line in (f'deeppool_job_gpus{{job="{job_id}"}} 1.0', 'deeppool_resizes{phase="DONE"} 1.0',
                 'deeppool_resize_last_seconds{part="restart"} 3.0',
                 f'deeppool_job_iteration_seconds{{batch="64",gpus="1",job="{job_id}"}} 0.2'):
        assert line in text, text


def test_serve_takes_simulate_policy_names_or_says_why_not() -> None:
    assert live_policy("pollux").elastic and not live_policy("fifo-backfill").elastic
    assert live_policy("tiresias:burst+bg").policy.name == "tiresias:burst+bg"
    with pytest.raises(DeeppoolError, match="burst\\+demand cannot run in the coordinator: .*plan offers"):
        live_policy("burst+demand")
    with pytest.raises(DeeppoolError, match="unknown --policy"):
        live_policy("fastest")


def test_serve_policy_interval_sets_pollux_s_tick_and_no_other_policy_s() -> None:
    ticking = live_policy("pollux", interval_s=20.0).policy
    assert isinstance(ticking, PolluxPolicy) and ticking.interval_s == 20.0
    default = live_policy("pollux").policy
    assert isinstance(default, PolluxPolicy) and default.interval_s == 60.0
    with pytest.raises(DeeppoolError, match="--policy-interval is for a policy that decides on a tick .*"
                                            "fifo-backfill:burst\\+bg decides at every event"):
        live_policy("fifo-backfill:burst+bg", interval_s=20.0)
    with pytest.raises(DeeppoolError, match="--policy-interval 0.0 must be more than 0"):
        live_policy("pollux", interval_s=0.0)


def _job(*, gpus: int, batch: int, steps: int):
    from datetime import UTC, datetime

    from deeppool.coordinator.jobs import Job

    now = datetime.now(UTC)
    return Job(id=1, kind=JobKind.FOREGROUND, state=JobStatus.RUNNING, owner="alice", model="m.py", gpus=gpus,
               batch=batch, steps=steps, amplification=None, created_at=now, updated_at=now)
