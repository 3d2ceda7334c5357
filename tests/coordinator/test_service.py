"""The coordinator schedules with the simulator's policy: one snapshot, one decision, applied to real jobs."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from deeppool.coordinator.jobs import JobKind, JobRequest, JobStatus
from deeppool.coordinator.launcher import LocalLauncher
from deeppool.coordinator.runtime import Runtime
from deeppool.coordinator.service import Service, snapshot
from deeppool.coordinator.store import Store
from deeppool.scheduling import Decision, Order, PlanMode, Placement, Scheduler, Start, policy_named
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
