"""Guests of another account join and leave running hosts, through brokers their hosts' supervisors start.

Jobs run as ``dpalice`` and ``dpbob`` (created here with useradd, removed afterwards; skipped where that cannot
be done), through the real launcher, supervisor and cgroups, with the server's side (store, runtime, service,
lending) in this process, as root.
"""

from __future__ import annotations

import json
import os
import pwd
import socket
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from deeppool.coordinator.guest import GuestSpec, replica_progress
from deeppool.coordinator.isolation import Account, RunAs, RunAsKind
from deeppool.coordinator.jobgroup import CgroupRoot
from deeppool.coordinator.jobs import Job, JobKind, JobRequest, JobStatus
from deeppool.coordinator.launcher import LocalLauncher
from deeppool.coordinator.lending import Lending
from deeppool.coordinator.lent_brokers import LentBrokers, read_brokers, write_brokers
from deeppool.coordinator.runtime import read_json
from deeppool.coordinator.store import Store
from deeppool.coordinator.supervisor import JobFiles
from deeppool.multiplex.guests import report_path
from tests.coordinator.accounts import ALICE, BOB
from tests.coordinator.test_isolation import BURST, REPO, SPY, Cluster
from tests.multiplex.plans import BACKGROUND, burst_plan

pytestmark = pytest.mark.slow
HOST_STEPS = 600
"""The heavy test's host's steps: enough for two guests to load and train one after the other in its windows."""




def _cgroups(folder: Path) -> CgroupRoot:
    root = CgroupRoot.here(folder)
    if root is None:
        pytest.skip("no writable cgroup v2 tree: guests of another account are not lent")
    return root


def _ask(path: Path, request: dict) -> dict:
    """A host's request to a broker, and its answer (any descriptors it hands over are closed)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(str(path))
        conn.sendall(json.dumps(request).encode() + b"\n")
        message, fds, _, _ = socket.recv_fds(conn, 4096, 4)
        for fd in fds:
            os.close(fd)
    return json.loads(message.split(b"\n")[0])


def test_a_lent_guests_broker_starts_only_its_loans_ranks_and_measures_nothing(shared: Path, users) -> None:
    """The supervisor starts a broker when the server names a guest lent its running attempt, and retires it when
    the name goes; that broker serves the ranks of the loan alone, and no measurement."""
    folder = shared / "jobs"
    root = _cgroups(folder)
    folder.mkdir(mode=0o711)
    files = JobFiles(folder=folder, job_id=1, attempt=1)
    guest = GuestSpec(job_id=2, account=Account.named(BOB), folder=folder / "job-2", log=folder / "job-2.log",
                      model=str(BACKGROUND), batch=8, roots=(BACKGROUND.parent,), ranks=4, lent=(1, 3), steps=5)
    host = root.group(1, 1)
    host.create()
    lent = LentBrokers(files, host=Account.named(ALICE), group=host)
    try:
        lent.update(files.log)
        assert not lent.brokers  # no guest lent yet: no broker
        write_brokers(files.guest_brokers, [guest])
        assert stat.S_IMODE(files.guest_brokers.stat().st_mode) == 0o600 and files.guest_brokers.stat().st_uid == 0
        lent.update(files.log)
        sock = files.lent_socket(2)
        info = sock.stat()
        assert stat.S_ISSOCK(info.st_mode) and info.st_uid == pwd.getpwnam(ALICE).pw_uid
        assert stat.S_IMODE(info.st_mode) == 0o600
        for request in ({"op": "child", "rank": 0}, {"op": "child", "rank": 2}, {"op": "child", "rank": 4},
                        {"op": "measure"}):
            assert "plan allows" in _ask(sock, request).get("error", ""), request
        assert not lent.spawned  # nothing ran for a rank outside the loan, nor a measurement
        write_brokers(files.guest_brokers, [])  # the guest left
        lent.update(files.log)
        assert not sock.exists() and not lent.brokers
    finally:
        lent.close()
        host.end()


@pytest.fixture
def lending(shared: Path, users) -> Iterator[tuple[Store, Lending, Job]]:
    """A server's loans across accounts, with dpalice's foreground job running on a 2-rank burst plan."""
    store = Store(shared / "db.sqlite")
    launcher = LocalLauncher(shared / "jobs")
    if not launcher.brokers_guests:
        pytest.skip("no writable cgroup v2 tree: guests of another account are not lent")
    lending = Lending(store, launcher, lambda path, job: read_json(path, pwd.getpwnam(job.owner).pw_uid),
                      run_as=RunAs(kind=RunAsKind.SUBMITTER))
    for name in (ALICE, BOB):
        store.create_token(name)
    host, _ = store.submit(ALICE, JobRequest(kind=JobKind.FOREGROUND, model=str(BURST), gpus=2, batch=64))
    store.transition(host.id, JobStatus.STARTING, "granted")
    store.transition(host.id, JobStatus.RUNNING, "running")
    plan = launcher.folder / f"job-{host.id}" / "plan.json"
    plan.parent.mkdir()
    burst_plan().save(plan)
    os.chown(plan, pwd.getpwnam(ALICE).pw_uid, -1)  # the host's own file
    yield store, lending, _job(store, host.id)
    store.close()


def _job(store: Store, job_id: int) -> Job:
    job = store.job(job_id)
    assert job is not None
    return job


def _says(path: Path, owner: str, data: dict) -> None:
    """A file ``owner``'s process wrote."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    os.chown(path, pwd.getpwnam(owner).pw_uid, -1)


def test_a_guest_of_another_account_is_lent_through_its_broker_and_settled_by_its_own_word(
        lending: tuple[Store, Lending, Job]) -> None:
    store, lending, host = lending
    guest, _ = store.submit(BOB, JobRequest(kind=JobKind.BACKGROUND, model=str(BACKGROUND), batch=8, steps=10))
    assert lending.joins(host, guest)  # it joins the running host (one waiting at a host's start is given then)
    assert lending.given_at_start(host, guest)
    (slot,) = lending.free_slots([host])
    assert lending.lend(guest, host, (slot.rank,), "lent rank 1")
    files = lending.launcher.files(host.id, 1)
    (loan,) = lending.loans(host.id, 1).values()
    assert loan.broker == files.lent_socket(guest.id) and loan.ranks == (1,) and loan.steps == 10
    (spec,) = lending.brokered(host.id, 1).values()  # what its broker starts comes from the server's file
    assert (spec.job_id, spec.account.name, spec.lent, spec.steps, spec.ranks) == (guest.id, BOB, (1,), 10, 2)
    assert files.guest_brokers.stat().st_uid == 0 and stat.S_IMODE(files.guest_brokers.stat().st_mode) == 0o600
    assert lending.free_slots([host]) == []

    run = lending.launcher.folder / f"job-{host.id}" / "run"
    _says(report_path(run, guest.id, 1), ALICE, {"state": "finished", "steps": 10})  # the host's word
    _says(replica_progress(loan.folder, 0), BOB, {"state": "running", "steps": 3})  # the guest's own
    assert lending.settle(_job(store, guest.id), host)
    assert _job(store, guest.id).state is JobStatus.RUNNING and _job(store, guest.id).progress == 0.3
    _says(replica_progress(loan.folder, 0), ALICE, {"state": "running", "steps": 10})  # not the guest's file
    lending.settle(_job(store, guest.id), host)
    assert _job(store, guest.id).state is JobStatus.RUNNING
    _says(replica_progress(loan.folder, 0), BOB, {"state": "running", "steps": 10})
    lending.settle(_job(store, guest.id), host)
    done = _job(store, guest.id)
    assert done.state is JobStatus.SUCCEEDED and done.reason == f"trained 10 steps in job {host.id}'s idle windows"
    lending.sync([host])  # it left: its loan and its broker's name go
    assert lending.loans(host.id, 1) == {} and read_brokers(files.guest_brokers) == {}


def test_a_cancelled_guest_of_another_account_loses_its_loan_and_its_broker(
        lending: tuple[Store, Lending, Job]) -> None:
    store, lending, host = lending
    guests = [store.submit(BOB, JobRequest(kind=JobKind.BACKGROUND, model=str(BACKGROUND), batch=8))[0]
              for _ in range(2)]
    for guest in guests:
        assert lending.lend(guest, host, (1,), "lent rank 1")
    store.transition(guests[0].id, JobStatus.CANCELLED, "cancelled by its owner")
    lending.sync([host])
    assert list(lending.loans(host.id, 1)) == [guests[1].id]
    assert list(lending.brokered(host.id, 1)) == [guests[1].id]


def test_a_guest_of_another_account_whose_host_ends_first_is_requeued_with_its_steps(
        lending: tuple[Store, Lending, Job]) -> None:
    store, lending, host = lending
    guest, _ = store.submit(BOB, JobRequest(kind=JobKind.BACKGROUND, model=str(BACKGROUND), batch=8, steps=10))
    assert lending.lend(guest, host, (1,), "lent rank 1")
    (loan,) = lending.loans(host.id, 1).values()
    _says(replica_progress(loan.folder, 0), BOB, {"state": "running", "steps": 4})
    store.transition(host.id, JobStatus.SUCCEEDED, "finished")
    assert lending.settle(_job(store, guest.id), _job(store, host.id))
    requeued = _job(store, guest.id)
    assert requeued.state is JobStatus.PENDING and requeued.host_id is None and requeued.progress == 0.4
    assert requeued.reason == (f"job {host.id} ended (SUCCEEDED) after 4 background steps: requeued, to resume "
                               "from its checkpoint")


def _ticks(cluster: Cluster, done: Callable[[], bool], timeout_s: float, why: Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, why()
        cluster.service.tick()
        time.sleep(0.2)


@pytest.mark.heavy
def test_another_users_background_job_joins_a_running_foreground_job_as_its_own_account(
        shared: Path, users, monkeypatch: pytest.MonkeyPatch) -> None:
    """dpalice's foreground job runs; dpbob's background jobs are submitted after it started. The first joins it
    through a broker her job's supervisor starts for it, trains its steps as dpbob and SUCCEEDED while she trains
    on; the second joins, is cancelled, and leaves; she SUCCEEDED."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # the server's environment: staged models import examples/
    from deeppool.coordinator.driver import DriverSteps

    cluster = Cluster(shared, gpus=2)
    if not cluster.runtime.launcher.brokers_guests:
        pytest.skip("no writable cgroup v2 tree: guests of another account are not lent")
    folder, store = cluster.folder, cluster.store
    models = shared / "models"
    models.mkdir(mode=0o755)
    roots = (models, BURST.parent, BACKGROUND.parent)
    cluster.runtime.steps = DriverSteps(folder=folder, run_as=RunAs(kind=RunAsKind.SUBMITTER), allowed_roots=roots)
    cluster.runtime.allowed_roots = cluster.runtime.lending.allowed_roots = roots
    host, _ = store.submit(ALICE, JobRequest(kind=JobKind.FOREGROUND, model=str(BURST), gpus=2, batch=64,
                                             steps=HOST_STEPS))

    def history() -> str:
        return "\n".join(f"job {j.id} {j.state.value}: " + "; ".join(e.reason for e in store.events(j.id))
                         for j in store.jobs()) + "\n" + cluster.log(_job(store, host.id))[-3000:]

    _ticks(cluster, lambda: bool(cluster.runtime.lending.free_slots([_job(store, host.id)])), 300, history)
    spy = models / "spy.py"
    spy.write_text(SPY.format(targets=[str(p) for p in (folder / f"job-{host.id}.log", folder / f"job-{host.id}",
                                                         shared / "db.sqlite")]))
    spy.chmod(0o644)
    guest, _ = store.submit(BOB, JobRequest(kind=JobKind.BACKGROUND, model=str(spy), batch=8, steps=20))
    _ticks(cluster, lambda: _job(store, guest.id).state.terminal, 300, history)
    trained = _job(store, guest.id)
    assert trained.state is JobStatus.SUCCEEDED and trained.reason == f"trained 20 steps in job {host.id}'s idle " \
                                                                      "windows", history()
    assert trained.host_id == host.id and trained.progress == 1.0
    assert _job(store, host.id).state is JobStatus.RUNNING, history()  # the guest left; its host trains on
    files = cluster.runtime.launcher.files(host.id, 1)
    _ticks(cluster, lambda: not files.lent_socket(guest.id).exists(), 30, history)  # its broker retired

    leaving, _ = store.submit(BOB, JobRequest(kind=JobKind.BACKGROUND, model=str(BACKGROUND), batch=8,
                                              steps=100_000))
    _ticks(cluster, lambda: _job(store, leaving.id).progress > 0 or _job(store, leaving.id).state.terminal, 300,
           history)
    assert _job(store, leaving.id).state is JobStatus.RUNNING, history()
    group = cluster.runtime.launcher.group(host.id, 1)
    assert group is not None and (group.path / f"guest-{leaving.id}.rank1").is_dir()
    assert store.transition(leaving.id, JobStatus.CANCELLED, "cancelled by its owner")
    _ticks(cluster, lambda: not (group.path / f"guest-{leaving.id}.rank1").exists(), 60, history)
    assert _job(store, host.id).state is JobStatus.RUNNING, history()  # its process ended; the host trains on
    _ticks(cluster, lambda: _job(store, host.id).state.terminal, 600, history)
    assert _job(store, host.id).state is JobStatus.SUCCEEDED, history()

    bob = pwd.getpwnam(BOB)
    log = cluster.log(trained)  # the guest's processes write to the guest's own log, never to its host's
    assert f"spy: runs as {bob.pw_uid} {BOB} in {folder / f'job-{guest.id}'}" in log, log[-3000:]
    assert "spy: read" not in log and "spy: refused PermissionError" in log, log[-3000:]
    assert "spy:" not in cluster.log(_job(store, host.id))
    for job in (guest, leaving):  # its checkpoints and its word on its steps are its own
        mine = [*(folder / f"job-{job.id}" / "background").glob("*.pt"),
                *(folder / f"job-{job.id}").glob("progress-replica*.json")]
        assert len(mine) >= 2 and all(p.stat().st_uid == bob.pw_uid for p in mine), mine
    assert not group.path.exists()  # every process ended, the nested groups removed
