"""A careless or hostile job against the machine it shares: a full disk, no descriptors, a fork bomb, a memory
hog, orphans, and what it leaves in ``/tmp``, ``/dev/shm`` and SysV IPC. Each on real processes, as root with
jobs run as accounts of their own (skipped where the tests cannot make accounts)."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import sqlite3
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from deeppool.coordinator.app import ServerSettings, create_app
from deeppool.coordinator.isolation import RunAs, RunAsKind, ServerShortage
from deeppool.coordinator.jobgroup import v1_roots
from deeppool.coordinator.jobs import Job, JobKind, JobRequest, JobStatus
from deeppool.coordinator.launcher import LaunchPhase, LocalLauncher
from deeppool.coordinator.retention import Retention, sweep
from deeppool.coordinator.runtime import Runtime
from deeppool.coordinator.store import RESERVE_BYTES, Store
from deeppool.coordinator.supervisor import JobCaps
from tests.coordinator.accounts import ALICE, small_tmpfs
from tests.coordinator.test_runtime import settle

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]




@pytest.fixture
def small_disk(shared: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs (root only) holding the database and the jobs' folders, unmounted afterwards."""
    with small_tmpfs(shared, 24) as disk:
        yield disk


class Cluster:
    def __init__(self, folder: Path, *, caps: JobCaps | None = None) -> None:
        self.folder = folder / "jobs"
        self.store = Store(folder / "db.sqlite")
        self.store.create_token(ALICE)
        self.steps: dict[int, list[list[str]]] = {}
        self.runtime = Runtime(self.store, LocalLauncher(self.folder, caps=caps or JobCaps()),
                               lambda job, attempt, guests: self.steps[job.id], grace_s=0.5,
                               run_as=RunAs(kind=RunAsKind.SUBMITTER))

    def start(self, code: str, *args: str) -> Job:
        job, _ = self.store.submit(ALICE, JobRequest(kind=JobKind.BACKGROUND, model="examples.mlp:model", batch=8))
        self.steps[job.id] = [[sys.executable, "-c", code, *args]]
        assert self.runtime.start(job, "granted")
        return job

    def run(self, code: str, *args: str) -> Job:
        job = self.start(code, *args)
        return settle(self.runtime, job.id, lambda j: j.state.terminal)

    def log(self, job: Job) -> str:
        return self.runtime.launcher.files(job.id, 1).log.read_text(errors="replace")


FILL = """
import os, time
with open('fill', 'wb') as out:
    try:
        while True:
            out.write(b'x' * (1 << 20)); out.flush()
    except OSError as err:
        print('full:', err.strerror, flush=True)
"""


def test_a_job_that_fills_the_disk_and_exits_0_is_recorded_succeeded(small_disk: Path, users) -> None:
    cluster = Cluster(small_disk)
    assert cluster.store.reserve.stat().st_size == RESERVE_BYTES  # the database's room, taken at start
    job = cluster.start(FILL)
    exit_file = cluster.runtime.launcher.files(job.id, 1).exit
    deadline = time.monotonic() + 60
    while not exit_file.exists():  # the supervisor's exit file is written into room it took at start
        assert time.monotonic() < deadline, cluster.log(job)
        time.sleep(0.05)
    http = TestClient(create_app(cluster.store, ServerSettings(gpus=4, allowed_roots=(REPO / "examples",),
                                                               log_dir=cluster.folder)))
    token = cluster.store.create_token("dpbob")  # the reserve makes room for the server's own commits
    health = http.get("/healthz")
    assert health.status_code == 503 and "disk is full" in health.json()["detail"], health.text
    refused = http.post("/v1/jobs", json={"kind": "bg", "model": "examples.mlp:model", "batch": 8, "input_shape": [16]},
                        headers={"Authorization": f"Bearer {token}"})
    assert refused.status_code == 503 and "disk is full" in refused.json()["detail"], refused.text
    assert "\n" not in refused.json()["detail"]
    for _ in range(20):  # the full disk: the job's end is recorded from its exit file, never as lost
        with contextlib.suppress(Exception):  # a failed tick: the scheduling loop retries it
            cluster.runtime.reconcile()
        assert cluster.store.job(job.id).state is not JobStatus.FAILED, cluster.store.job(job.id).reason
        time.sleep(0.05)
    (cluster.folder / f"job-{job.id}" / "fill").unlink()  # space returns
    done = settle(cluster.runtime, job.id, lambda j: j.state.terminal)
    assert done.state is JobStatus.SUCCEEDED and done.exit_code == 0, (done.reason, cluster.log(job))
    assert "full: No space left on device" in cluster.log(job)
    assert http.get("/healthz").json() == {"ok": True}
    assert cluster.store.reserve.exists()  # taken again


def test_a_job_that_filled_the_disk_leaves_it_and_the_service_recovers_alone(small_disk: Path, users) -> None:
    """The issue's case: a job fills the disk shared with the database and exits 0. It is recorded SUCCEEDED,
    and its files, the oldest ended, are removed for room: /healthz is ok again with no operator."""
    cluster = Cluster(small_disk)
    retention = Retention(keep_s=None, min_free_bytes=12 << 20)  # above the database's reserve (8 MiB)
    http = TestClient(create_app(cluster.store, ServerSettings(gpus=4, allowed_roots=(REPO / "examples",),
                                                               log_dir=cluster.folder, retention=retention)))
    job = cluster.start(FILL)
    deadline = time.monotonic() + 60
    while not cluster.runtime.launcher.files(job.id, 1).exit.exists():
        assert time.monotonic() < deadline, cluster.log(job)
        time.sleep(0.05)
    assert http.get("/healthz").status_code == 503
    done = settle(cluster.runtime, job.id, lambda j: j.state.terminal)
    assert done.state is JobStatus.SUCCEEDED and done.exit_code == 0, done.reason
    assert sweep(cluster.store, cluster.folder, retention).removed == (job.id,)
    assert not (cluster.folder / f"job-{job.id}").exists()
    assert http.get("/healthz").json() == {"ok": True}
    assert os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize >= 12 << 20


def test_a_job_is_never_recorded_lost_or_accountless_when_the_server_has_no_descriptors(shared: Path,
                                                                                        users) -> None:
    cluster = Cluster(shared)
    job = cluster.start("print('done')")
    exit_file = cluster.runtime.launcher.files(job.id, 1).exit
    deadline = time.monotonic() + 60
    while not exit_file.exists():
        assert time.monotonic() < deadline, cluster.log(job)
        time.sleep(0.05)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    held = []
    try:
        while True:  # every descriptor this process may open, taken
            try:
                held.append(os.open("/dev/null", os.O_RDONLY))
            except OSError as err:
                assert err.errno == errno.EMFILE
                break
        for _ in range(3):
            with pytest.raises((ServerShortage, OSError, sqlite3.Error)):
                cluster.runtime.reconcile()
            seen = cluster.store.job(job.id)
            assert not seen.state.terminal, seen.reason
        with pytest.raises(ServerShortage):  # no /etc/passwd to read says nothing of an account
            RunAs(kind=RunAsKind.SUBMITTER).account(ALICE)
    finally:
        for fd in held:
            os.close(fd)
    assert (soft, hard) == resource.getrlimit(resource.RLIMIT_NOFILE)
    done = settle(cluster.runtime, job.id, lambda j: j.state.terminal)
    assert done.state is JobStatus.SUCCEEDED, done.reason


def test_a_job_over_its_disk_cap_is_stopped(shared: Path, users) -> None:
    cluster = Cluster(shared, caps=JobCaps(disk_bytes=4 << 20))
    job = cluster.run("import time\nwith open('big', 'wb') as out:\n"
                      "    for _ in range(200):\n        out.write(b'x' * (1 << 20)); out.flush(); time.sleep(0.02)\n"
                      "print('wrote it all')")
    assert job.state is JobStatus.FAILED and "disk cap of 4194304 bytes" in job.reason, job.reason
    assert "passed its cap of 4194304 bytes" in cluster.log(job) and "wrote it all" not in cluster.log(job).splitlines()


FORK_BOMB = """
import os, time
made = 0
for _ in range(500):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    made += 1
print('forked', made, flush=True)
"""


def test_a_fork_bomb_is_bounded_by_the_jobs_process_limit(shared: Path, users) -> None:
    cluster = Cluster(shared, caps=JobCaps(pids=20))
    job = cluster.run(FORK_BOMB)
    forked = int(cluster.log(job).split("forked ")[1].split()[0])
    assert forked < 20, cluster.log(job)
    assert job.state is JobStatus.SUCCEEDED


def test_a_memory_hog_is_killed_by_its_own_limit_and_the_server_lives(shared: Path, users) -> None:
    cluster = Cluster(shared, caps=JobCaps(memory_bytes=200 << 20))
    job = cluster.run("blob = bytearray(2 << 30)\nprint('allocated', len(blob))")
    log = cluster.log(job)  # its cgroup's OOM kill (memory.max), or its allocation refused (RLIMIT_DATA)
    assert job.state is JobStatus.FAILED and "allocated 2147483648" not in log, log
    assert "MemoryError" in log or job.exit_code == -9, (job.reason, log)
    if "memory" in v1_roots():  # a memory controller (this machine's, in v1): the kernel's OOM kill, not an rlimit
        assert job.exit_code == -9, (job.reason, log)
    assert cluster.run("print('fine')").state is JobStatus.SUCCEEDED  # the server (this process) goes on


IN_GROUP = """
import time
for line in open('/proc/self/cgroup'):
    _, names, path = line.strip().split(':', 2)
    for controller in ('pids', 'memory'):
        if controller in names.split(','):
            print(controller, path, flush=True)
time.sleep(3)
"""


def test_on_a_hybrid_host_the_limits_are_the_v1_controllers(shared: Path, users) -> None:
    """Where the pids and memory controllers live in cgroup v1 hierarchies (this machine's), a job's processes
    are in its attempt's groups there, which hold its limits; the groups go with the job."""
    roots = v1_roots()
    if not {"pids", "memory"} <= roots.keys():
        pytest.skip("no cgroup v1 pids and memory hierarchies here")
    cluster = Cluster(shared, caps=JobCaps(pids=20, memory_bytes=200 << 20))
    job = cluster.start(IN_GROUP)
    deadline = time.monotonic() + 30
    log = cluster.runtime.launcher.files(job.id, 1).log
    while len(paths := dict(line.split() for line in (log.read_text() if log.exists() else "").splitlines()
                            if line.startswith(("pids /", "memory /")))) < 2:
        assert time.monotonic() < deadline, cluster.log(job)
        time.sleep(0.05)
    mounts = {controller: Path("/sys/fs/cgroup", controller) for controller in roots}
    groups = {controller: mounts[controller] / path.lstrip("/") for controller, path in paths.items()}
    assert all(group.name == f"job-{job.id}.1" and group.parent.name.startswith("deeppool-")
               for group in groups.values()), groups
    assert (groups["pids"] / "pids.max").read_text().strip() == "20"
    assert (groups["memory"] / "memory.limit_in_bytes").read_text().strip() == str(200 << 20)
    assert settle(cluster.runtime, job.id, lambda j: j.state.terminal).state is JobStatus.SUCCEEDED
    assert not any(group.exists() for group in groups.values())  # removed with the job

ORPHANS = """
import os, sys, time
for _ in range(200):
    if os.fork() == 0:
        if os.fork() == 0:
            os._exit(0)  # the grandchild: re-parented to the supervisor, a zombie unless it is reaped
        os._exit(0)
    os.wait()
print('orphaned', flush=True)
time.sleep(6)
"""


def _zombies_of(pid: int) -> int:
    found = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            found += fields[0] == "Z" and int(fields[1]) == pid
    return found


def test_the_supervisor_reaps_orphans_while_the_job_runs(shared: Path, users) -> None:
    cluster = Cluster(shared)
    job = cluster.start(ORPHANS)
    deadline = time.monotonic() + 60
    while "orphaned" not in (cluster.log(job) if cluster.runtime.launcher.files(job.id, 1).log.exists() else ""):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    supervisor = cluster.runtime.launcher.files(job.id, 1).supervisor_pid()
    assert supervisor is not None
    deadline = time.monotonic() + 4  # the job sleeps 6 s: unreaped, its 200 orphans would all be zombies till then
    while _zombies_of(supervisor) > 0:
        assert time.monotonic() < deadline, f"{_zombies_of(supervisor)} zombies"
        time.sleep(0.1)
    assert cluster.runtime.launcher.observe(job.id, 1).phase is LaunchPhase.RUNNING  # reaped while it runs
    assert settle(cluster.runtime, job.id, lambda j: j.state.terminal).state is JobStatus.SUCCEEDED


LEAVES = """
import ctypes, os, sys
name = sys.argv[1]
open('/tmp/' + name, 'w').write('left')
with open('/dev/shm/' + name, 'wb') as out:
    out.write(b'x' * (8 << 20))
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.restype = ctypes.c_int
shm = libc.shmget(0x5EED, 64 << 20, 0o1600)  # IPC_CREAT | 0600
print('made', shm, os.listdir('/tmp').count(name), flush=True)
"""


def _segments(uid: int) -> list[str]:
    lines = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    return [line for line in lines if int(line.split()[7]) == uid]


def test_a_job_leaves_nothing_in_tmp_dev_shm_or_sysv_ipc(shared: Path, users) -> None:
    import pwd

    uid = pwd.getpwnam(ALICE).pw_uid
    name = f"dp-leftover-{os.getpid()}"
    before = _segments(uid)
    cluster = Cluster(shared)
    job = cluster.run(LEAVES, name)
    log = cluster.log(job)
    assert job.state is JobStatus.SUCCEEDED and "made " in log, log
    shm_id = int(log.split("made ")[1].split()[0])
    assert shm_id >= 0 and log.split("made ")[1].split()[1] == "1", log  # it did make them
    assert not Path("/tmp", name).exists() and not Path("/dev/shm", name).exists()
    assert _segments(uid) == before


def test_a_jobs_private_tmp_still_shows_the_servers_folders(users) -> None:
    """Jobs' folders under /tmp (the server's, root's) stay where they were inside the job's private /tmp."""
    with tempfile.TemporaryDirectory(dir="/tmp") as base:
        folder = Path(base)
        folder.chmod(0o711)
        cluster = Cluster(folder)
        job = cluster.run("import os; print(os.getcwd(), os.path.isdir(os.getcwd()))")
        assert job.state is JobStatus.SUCCEEDED and "True" in cluster.log(job), cluster.log(job)


def test_a_supervisor_that_cannot_open_the_log_records_why_never_lost(shared: Path, users) -> None:
    cluster = Cluster(shared)
    job, _ = cluster.store.submit(ALICE, JobRequest(kind=JobKind.BACKGROUND, model="examples.mlp:model", batch=8))
    cluster.steps[job.id] = [[sys.executable, "-c", "print('ran')"]]
    (cluster.folder / f"job-{job.id}.log").mkdir()  # as a full disk would, the log cannot be opened
    assert cluster.runtime.start(job, "granted")
    done = settle(cluster.runtime, job.id, lambda j: j.state.terminal)
    assert done.state is JobStatus.FAILED and done.reason.startswith("its supervisor failed: IsADirectoryError"), \
        done.reason


@pytest.mark.parametrize("option", ["--max-job-pids", "--max-job-memory-mb", "--max-job-disk-mb"])
def test_serve_refuses_a_job_limit_below_1(tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str) -> None:
    from tests.entry import deeppool

    done = deeppool(capsys, "serve", "--db", str(tmp_path / "db.sqlite"), option, "0")
    assert done.code == 2 and done.stderr.startswith(f"error: {option} 0 must be at least 1"), done.stderr
    assert not (tmp_path / "db.sqlite").exists()
