"""The coordinator schedules with the simulator's policy: one snapshot, one decision, applied to real jobs."""

from __future__ import annotations

import math
from dataclasses import fields
from datetime import UTC, datetime
from pathlib import Path

from deeppool.coordinator import store as store_module
from deeppool.coordinator.elastic import Elastic
from deeppool.coordinator.jobs import JobKind, JobRequest, JobStatus, SpeedPoint
from deeppool.coordinator.launcher import LocalLauncher
from deeppool.coordinator.runtime import Runtime
from deeppool.coordinator.service import Service, policy_view, snapshot
from deeppool.coordinator.store import Store
from deeppool.coordinator.waiting import WaitingJobs
from deeppool.scheduling import Decision, Order, Placement, PlanMode, Scheduler, Snapshot, Start, policy_named
from tests.multiplex.plans import burst_plan


def queue(tmp_path: Path) -> Store:
    store = Store(tmp_path / "db.sqlite")
    store.create_token("alice")
    for kind, gpus in ((JobKind.BACKGROUND, 1), (JobKind.FOREGROUND, 2), (JobKind.FOREGROUND, 4),
                       (JobKind.BACKGROUND, 1), (JobKind.FOREGROUND, 1)):
        store.submit("alice", JobRequest(kind=kind, model="examples.mlp:model", gpus=gpus, batch=64))
    return store


def test_one_snapshot_gives_the_same_decision_to_the_simulator_and_the_coordinator(tmp_path: Path) -> None:
    store = queue(tmp_path)
    view = snapshot(store.jobs(), 4, datetime.now(UTC))
    coordinator = Scheduler(order=Order.FIFO_BACKFILL, placement=Placement.BURST_BG)
    simulator = policy_named("fifo-backfill:burst+bg")  # what `deeppool simulate --policy` runs
    # by hand, 4 free GPUs, queue [bg 1 GPU, fg 2, fg 4, bg 1, fg 1]: foreground first in submission order
    # with backfilling, so job 2 takes 2 GPUs, job 3 (4 GPUs) waits and job 5 (1 GPU) fits; the first
    # background job takes the last free GPU; nothing runs yet, so there is no idle rank to lend to job 4
    # (it waits as a guest, see below), nothing to preempt or rebatch; burst+bg plans lend their idle time
    expected = Decision(start=(Start(job_id=2, gpus=2, mode=PlanMode.LENDING),
                               Start(job_id=5, gpus=1, mode=PlanMode.LENDING),
                               Start(job_id=1, gpus=1, mode=PlanMode.LENDING)))
    assert coordinator.decide(view) == expected
    assert simulator.decide(view) == expected


class Recorder(LocalLauncher):
    def __init__(self, folder: Path) -> None:
        super().__init__(folder)
        self.launched: list[int] = []

    def launch(self, job_id: int, attempt: int, steps, env=None, resources=None, account=None, workdir=None,
               guest=None) -> None:
        self.launched.append(job_id)


def test_applying_a_decision_starts_jobs_then_lends_a_running_ones_idle_rank(tmp_path: Path) -> None:
    store = queue(tmp_path)
    launcher = Recorder(tmp_path / "jobs")
    service = Service(Runtime(store, launcher, lambda job, attempt, guests: [["true"]]),
                      Scheduler(order=Order.FIFO_BACKFILL, placement=Placement.BURST_BG), 4)
    service.tick()
    states = {job.id: job for job in store.jobs()}
    assert launcher.launched == [2, 5, 1]
    assert states[1].state is JobStatus.STARTING and states[1].host_id is None  # on a free GPU of its own
    assert states[4].state is JobStatus.PENDING  # no host runs a plan yet: it waits for an idle rank
    assert states[3].state is JobStatus.PENDING
    store.transition(2, JobStatus.RUNNING, "running")
    (launcher.folder / "job-2").mkdir()
    burst_plan().save(launcher.folder / "job-2" / "plan.json")  # rank 1 idle while layers run on rank 0
    decision = service.tick()
    assert [(lend.job_id, [(s.host, s.rank) for s in lend.slots]) for lend in decision.lend] == [(4, [(2, 1)])]
    guest = store.job(4)
    assert guest is not None and guest.state is JobStatus.STARTING and guest.host_id == 2
    assert guest.reason == "lent rank 1 of running job 2 by the fifo-backfill:burst+bg policy"
    assert list(service.runtime.lending.loans(2, 1)) == [4] and 4 not in launcher.launched  # its host's ranks start it


def test_a_paused_service_starts_nothing(tmp_path: Path) -> None:
    store = queue(tmp_path)
    launcher = Recorder(tmp_path / "jobs")
    service = Service(Runtime(store, launcher, lambda job, attempt, guests: [["true"]]),
                      Scheduler(order=Order.FIFO_BACKFILL, placement=Placement.BURST_BG), 4, paused=True)
    assert service.tick().empty and launcher.launched == []
    assert all(job.state is JobStatus.PENDING for job in store.jobs())


def test_the_waiting_jobs_read_once_give_the_policy_the_view_their_full_rows_give(tmp_path: Path) -> None:
    store = queue(tmp_path)
    waiting = WaitingJobs(store)
    queued = waiting.read()
    first = list(queued.jobs.values())
    assert [w.id for w in first] == [1, 2, 3, 4, 5] and not any(w.requeued for w in first)
    now = datetime.now(UTC)
    assert policy_view([], queued, 4, now) == snapshot(store.jobs(), 4, now)
    store.note(1, ["a straggler report"], prefix="attempt 1: ")  # no move: nothing read again
    assert waiting.read() is queued
    store.transition(2, JobStatus.STARTING, "granted")
    assert list(waiting.read().jobs) == [1, 3, 4, 5]
    store.transition(2, JobStatus.PENDING, "preempted")  # back in the queue, in its place: read again
    store.transition(4, JobStatus.CANCELLED, "cancelled")
    store.submit("alice", JobRequest(kind=JobKind.BACKGROUND, model="examples.mlp:model", batch=8))
    requeued = waiting.read()
    second = list(requeued.jobs.values())
    assert [w.id for w in second] == [1, 2, 3, 5, 6]
    assert [w is before for w, before in zip(second, (first[0], first[1], first[2], first[4]), strict=False)] == [
        True, False, True, True]
    assert second[1].requeued and not second[4].requeued
    assert policy_view([], requeued, 4, now) == snapshot(store.jobs(states=(JobStatus.PENDING,)), 4, now,
                                                       requeued=frozenset(store.requeued()))
    assert list(WaitingJobs(store).read().jobs) == [1, 2, 3, 5, 6]  # a new server reads the same queue


def test_a_tick_builds_a_full_row_only_for_the_jobs_it_starts(tmp_path: Path, monkeypatch) -> None:
    store = Store(tmp_path / "db.sqlite")
    store.create_token("alice")
    for _ in range(60):
        store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model="examples.mlp:model", gpus=1, batch=8))
    built: list[int] = []
    real = store_module._job
    monkeypatch.setattr(store_module, "_job", lambda row: built.append(row["id"]) or real(row))
    launcher = Recorder(tmp_path / "jobs")
    service = Service(Runtime(store, launcher, lambda job, attempt, guests: [["true"]]),
                      Scheduler(order=Order.FIFO_BACKFILL, placement=Placement.BURST_BG), 2)
    service.tick()
    assert launcher.launched == [1, 2]
    assert set(built) == {1, 2}  # the two it started, not the 58 still waiting
    built.clear()
    assert service.tick().empty and set(built) == {1, 2}  # a tick with no free GPU: the live rows only


class StartOnce:
    """Starts job ``job_id`` on ``gpus`` GPUs at its first decision, then decides nothing."""

    name = "start-once"

    def __init__(self, job_id: int, gpus: int) -> None:
        self.starts = [Start(job_id=job_id, gpus=gpus, mode=PlanMode.BURST)]

    def decide(self, snap) -> Decision:
        decision = Decision(start=tuple(self.starts))
        self.starts = []
        return decision


def test_a_start_waits_for_the_gpus_a_job_stopping_to_shrink_still_holds(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    store.create_token("alice")
    shrinking, _ = store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model="examples.mlp:model", gpus=3,
                                                    batch=64))
    waiting, _ = store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model="examples.mlp:model", gpus=2,
                                                  batch=64))
    store.transition(shrinking.id, JobStatus.STARTING, "started")
    store.transition(shrinking.id, JobStatus.RUNNING, "running")
    change = store.begin_resize(store.job(shrinking.id), 1, 64, "shrunk to 1 GPU")  # it stops at its next step
    assert change is not None
    launcher = Recorder(tmp_path / "jobs")
    service = Service(Runtime(store, launcher, lambda job, attempt, guests: [["true"]]),
                      StartOnce(waiting.id, 2), 4)
    service.tick()  # 3 GPUs held until the resize ends: 1 free, 2 asked
    service.tick()
    assert launcher.launched == [] and store.job(waiting.id).state is JobStatus.PENDING
    store.update_resize(change.id, "DONE")
    store.set_shape(shrinking.id, width=1, batch=64, steps=shrinking.steps, gain=None)
    service.tick()  # the decision of the first tick, carried out now that its GPUs are free
    assert launcher.launched == [waiting.id] and store.job(waiting.id).state is JobStatus.STARTING


class ElasticSteps:
    """A runtime's steps for jobs that run resizable (``DriverSteps.elastic``), launching nothing."""

    elastic = True

    def __call__(self, job, attempt, guests) -> list[list[str]]:
        return [["true"]]


class Comparing:
    """Decides as scripted (one decision a tick, then nothing), and keeps each snapshot it is given with the one
    the full rows give at the same instant (every live and waiting job read in full, :meth:`Elastic.view`)."""

    name = "comparing"

    def __init__(self, store: Store, elastic: Elastic, gpus: int) -> None:
        self.store, self.elastic, self.gpus = store, elastic, gpus
        self.script: list[Decision] = []
        self.seen: list[tuple[Snapshot, Snapshot]] = []

    def decide(self, snap: Snapshot) -> Decision:
        rows = self.store.jobs(states=(JobStatus.STARTING, JobStatus.RUNNING, JobStatus.PENDING))
        full = snapshot(rows, self.gpus, datetime.fromtimestamp(snap.now_s, UTC),
                        requeued=frozenset(self.store.requeued()), elastic=self.elastic.view(rows))
        self.seen.append((snap, full))
        return self.script.pop(0) if self.script else Decision()


def test_an_elastic_tick_keeps_the_waiting_jobs_and_gives_the_policy_the_view_their_full_rows_give(
        tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    store.create_token("alice")
    for kind, gpus, script in ((JobKind.FOREGROUND, 2, None), (JobKind.FOREGROUND, 1, None),
                               (JobKind.BACKGROUND, 1, None), (JobKind.FOREGROUND, 2, "examples/hf_user_loop.py"),
                               (JobKind.FOREGROUND, 2, None)):
        store.submit("alice", JobRequest(kind=kind, model="examples.mlp:model", gpus=gpus, batch=64, steps=100,
                                         script=script))
    runtime = Runtime(store, Recorder(tmp_path / "jobs"), ElasticSteps())
    elastic = Elastic(runtime, 4)
    policy = Comparing(store, elastic, 4)
    service = Service(runtime, policy, 4, elastic=elastic)

    def tick(*decisions: Decision) -> Snapshot:
        policy.script = list(decisions)
        service.tick()
        kept, full = policy.seen[-1]
        for name in (f.name for f in fields(Snapshot)):
            assert getattr(kept, name) == getattr(full, name), name
        return kept

    first = tick(Decision(start=(Start(job_id=1, gpus=2, mode=PlanMode.BURST),
                                 Start(job_id=3, gpus=1, mode=PlanMode.BURST))))
    assert [j.job_id for j in first.waiting] == [1, 2, 3, 4, 5] and all(j.speed for j in first.waiting)
    for job_id in (1, 3):
        store.transition(job_id, JobStatus.RUNNING, "running")
    store.record_speed(SpeedPoint(job_id=1, gpus=2, batch=64, iteration_s=0.3, steps=20, gns=200.0))
    store.record_speed(SpeedPoint(job_id=3, gpus=1, batch=64, iteration_s=0.5, steps=20))
    tick(Decision(start=(Start(job_id=2, gpus=3, mode=PlanMode.BURST),)))  # 1 GPU free: reshaped, still waiting
    reshaped = tick()
    assert [(j.job_id, j.gpus) for j in reshaped.waiting] == [(2, 3), (4, 2), (5, 2)]
    again = tick()  # nothing changed: the same views, not made again
    assert all(a is b for a, b in zip(again.waiting, reshaped.waiting, strict=True))
    assert again.running[0].speed.noise_scale == 200.0
    tick(Decision(preempt=(3,)))  # a background job: requeued
    change = store.begin_resize(store.job(1), 0, 64, "stopped resumably")  # a resize to 0, as its end leaves it
    store.transition(1, JobStatus.PENDING, "stopped resumably after step 40")
    store.update_resize(change.id, "DONE")
    requeued = tick()
    assert [j.job_id for j in requeued.requeued] == [1, 3] and requeued.adaptive[1].restarts == 1
    store.set_progress(1, 0.4)  # what a late look at its attempt finds, and a late speed report: while it waits
    store.record_speed(SpeedPoint(job_id=1, gpus=1, batch=64, iteration_s=0.5, steps=20, gns=250.0))
    late = tick()
    fit = next(j for j in late.waiting if j.job_id == 1).speed.fit  # from both its points now
    assert late.adaptive[1].progress == 40.0 and math.isclose(fit.iteration_s(1, 64), 0.5)
    assert [e.reason for e in store.events(1)][-2:] == ["changed while waiting: progress 0.4",
                                                        "changed while waiting: a speed measured on 1 GPUs at batch 64"]
