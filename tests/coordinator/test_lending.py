"""The coordinator's loans of running hosts' idle ranks: slots from the host's plan, loans kept in step with the
database, and a guest settled from its replicas' reports (a real store, launcher folder and plan; no processes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deeppool.coordinator.jobs import Job, JobKind, JobRequest, JobStatus
from deeppool.coordinator.launcher import LocalLauncher
from deeppool.coordinator.lending import Lending
from deeppool.coordinator.runtime import read_json
from deeppool.coordinator.store import Store
from deeppool.multiplex.guests import report_path
from deeppool.plans import Plan
from tests.multiplex.plans import BACKGROUND, burst_plan

FOREGROUND = Path(__file__).resolve().parent / "models" / "burst_cnn.py"


@pytest.fixture(scope="module")
def plan() -> Plan:
    return burst_plan()  # 2 ranks: rank 1 idle while two layers run on rank 0


@pytest.fixture
def setup(tmp_path: Path, plan: Plan) -> tuple[Store, Lending, Job]:
    store = Store(tmp_path / "deeppool.db")
    launcher = LocalLauncher(tmp_path / "logs", cgroups=False)
    lending = Lending(store, launcher, lambda path, job: read_json(path))
    store.create_token("alice")
    host, _ = store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model=str(FOREGROUND), gpus=2, batch=64))
    store.transition(host.id, JobStatus.STARTING, "granted")
    store.transition(host.id, JobStatus.RUNNING, "running")
    (launcher.folder / f"job-{host.id}").mkdir()
    plan.save(launcher.folder / f"job-{host.id}" / "plan.json")
    return store, lending, current(store, host.id)


def current(store: Store, job_id: int) -> Job:
    job = store.job(job_id)
    assert job is not None
    return job


def guest(store: Store, steps: int = 10) -> Job:
    job, _ = store.submit("alice", JobRequest(kind=JobKind.BACKGROUND, model=str(BACKGROUND), batch=8, steps=steps))
    return job


def report(lending: Lending, host: Job, job: Job, state: str, steps: int) -> None:
    path = report_path(lending.launcher.folder / f"job-{host.id}" / "run", job.id, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"state": state, "steps": steps}))


def test_a_running_host_offers_its_idle_rank_until_a_guest_holds_it(setup: tuple[Store, Lending, Job]) -> None:
    store, lending, host = setup
    (slot,) = lending.free_slots([host])
    assert (slot.host, slot.rank) == (host.id, 1) and 0 < slot.usable_fraction <= slot.idle_fraction <= 1
    first = guest(store)
    assert lending.lend(first, host, (1,), "lent rank 1")
    assert current(store, first.id).state is JobStatus.STARTING and current(store, first.id).host_id == host.id
    (loan,) = lending.loans(host.id, 1).values()
    assert loan.job_id == first.id and loan.ranks == (1,) and loan.steps == 10 and loan.folder.is_dir()
    assert lending.free_slots([host]) == []
    store.transition(first.id, JobStatus.CANCELLED, "cancelled")
    lending.sync([host])  # the cancelled guest's loan goes: the host's ranks stop its process
    assert lending.loans(host.id, 1) == {} and len(lending.free_slots([host])) == 1


def test_a_guest_settles_as_its_reports_and_its_host_say(setup: tuple[Store, Lending, Job]) -> None:
    store, lending, host = setup
    done, broken, left = guest(store, steps=4), guest(store), guest(store)
    for job in (done, broken, left):
        assert lending.lend(job, host, (1,), "lent")
    report(lending, host, done, "running", 2)
    assert lending.settle(current(store, done.id), host)
    assert current(store, done.id).state is JobStatus.RUNNING and current(store, done.id).progress == 0.5
    report(lending, host, done, "finished", 4)
    lending.settle(current(store, done.id), host)
    assert current(store, done.id).state is JobStatus.SUCCEEDED and current(store, done.id).progress == 1.0
    assert current(store, done.id).reason == f"trained 4 steps in job {host.id}'s idle windows"
    report(lending, host, broken, "failed", 0)
    lending.settle(current(store, broken.id), host)
    assert current(store, broken.id).state is JobStatus.FAILED
    report(lending, host, left, "stopped", 3)
    store.transition(host.id, JobStatus.SUCCEEDED, "finished")
    lending.settle(current(store, left.id), current(store, host.id))
    requeued = current(store, left.id)
    assert requeued.state is JobStatus.PENDING and requeued.host_id is None and "requeued" in requeued.reason


def test_a_host_with_a_guest_from_its_start_offers_nothing(setup: tuple[Store, Lending, Job]) -> None:
    store, lending, host = setup
    started = guest(store)
    store.transition(started.id, JobStatus.STARTING, "lent at its start", host_id=host.id)
    assert lending.free_slots([host]) == []
    assert not lending.settle(current(store, started.id), host)  # the runtime settles it from the summary


def test_a_resized_host_releases_its_guests(setup: tuple[Store, Lending, Job]) -> None:
    store, lending, host = setup
    lent = guest(store)
    assert lending.lend(lent, host, (1,), "lent")
    report(lending, host, lent, "stopped", 3)
    store.transition(host.id, JobStatus.STARTING, "resized to 1 GPU")  # its next attempt: a control file of its own
    lending.settle(current(store, lent.id), current(store, host.id))
    released = current(store, lent.id)
    assert released.state is JobStatus.PENDING and released.host_id is None
    assert released.reason == (f"job {host.id} was resized: its guests are released after 3 background steps: "
                               "requeued, to resume from its checkpoint")
    assert lending.loans(host.id, 2) == {}
