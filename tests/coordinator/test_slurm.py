"""Jobs through a real single-node Slurm: slurm-wlm and munge from Debian, started by this test's setup.

The fixture installs the packages when they are missing (root and apt-get),
starts munged, and runs a private slurmctld and slurmd on free ports with
their state in a temporary folder. The tests are skipped only where the
packages cannot be installed at all (not root, no apt-get, or apt-get
fails); a Slurm that is installed but does not come up fails them, naming
what did not (munged, slurmctld, slurmd) and the end of its log.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deeppool.coordinator.isolation import RunAs, RunAsKind
from deeppool.coordinator.jobs import JobKind, JobRequest, JobStatus
from deeppool.coordinator.launcher import LaunchPhase
from deeppool.coordinator.runtime import Runtime
from deeppool.coordinator.slurm import SlurmLauncher
from deeppool.coordinator.store import Store
from tests.coordinator.accounts import ALICE, BOB, accounts, job_folder
from tests.coordinator.test_runtime import settle
from tests.net import free_port

pytestmark = pytest.mark.slow

CONF = """ClusterName=deeppooltest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""



def _ensure_packages() -> None:
    if all(shutil.which(tool) for tool in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("slurm-wlm and munge are not installed, and apt-get is not available to root here")
    done = subprocess.run(["apt-get", "install", "-y", "-q", "slurm-wlm", "munge"], capture_output=True, text=True,
                          env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, timeout=900)
    if done.returncode != 0:
        pytest.skip(f"apt-get could not install slurm-wlm and munge: {done.stderr.strip()[-300:]}")


def _start_munge() -> bool:
    """Make sure munged runs; True if this call started it."""
    if subprocess.run(["sh", "-c", "munge -n | unmunge"], capture_output=True).returncode == 0:
        return False
    Path("/run/munge").mkdir(parents=True, exist_ok=True)
    shutil.chown("/run/munge", "munge", "munge")
    subprocess.run(["runuser", "-u", "munge", "--", "munged"], capture_output=True, timeout=30)
    if subprocess.run(["sh", "-c", "munge -n | unmunge"], capture_output=True).returncode != 0:
        log = Path("/var/log/munge/munged.log")
        tail = log.read_text(errors="replace")[-300:] if log.exists() else "no log"
        pytest.fail(f"munged did not come up, so Slurm cannot authenticate: {tail}")
    return True


def not_up(what: str, daemons: dict[str, subprocess.Popen], root: Path) -> str:
    """Why a private Slurm did not come up: which daemon exited (with its code), and the end of each log."""
    exited = [f"{name} exited with code {proc.poll()}" for name, proc in daemons.items() if proc.poll() is not None]
    logs = "; ".join(f"{log.name}: {log.read_text(errors='replace')[-300:]}" for log in sorted(root.glob("*.log")))
    return f"{what} did not come up in 60 s ({', '.join(exited) or 'the daemons still run'}); {logs or 'no logs'}"


def _stop_munge() -> None:
    """Stop the munged a fixture started (its pid file names it)."""
    try:
        os.kill(int(Path("/run/munge/munged.pid").read_text().strip()), signal.SIGTERM)
    except (OSError, ValueError):
        pass


def slurm_folder() -> Path:
    """A folder for a private Slurm's state and spool, which job accounts can pass through (slurmd runs a
    job's batch script from its spool, as the job's account): not under pytest's 0700 base folder."""
    root = Path(tempfile.mkdtemp(prefix="deeppool-slurm-"))
    root.chmod(0o711)
    return root


@pytest.fixture(scope="module")
def slurm() -> Iterator[dict[str, str]]:
    if os.geteuid() != 0:
        pytest.skip("the private Slurm's daemons run as root")
    _ensure_packages()
    started_munge = _start_munge()
    root = slurm_folder()
    for sub in ("state", "spool"):
        (root / sub).mkdir()
        (root / sub).chmod(0o755)  # explicitly: a server run in this process earlier left its umask 077
    conf = root / "slurm.conf"
    host = socket.gethostname().split(".")[0]
    conf.write_text(CONF.format(host=host, root=root, ctld_port=free_port(), d_port=free_port(),
                                cpus=os.cpu_count() or 1))
    conf.chmod(0o644)  # every job account's Slurm commands read it
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = {daemon: subprocess.Popen([daemon, "-D", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL) for daemon in ("slurmctld", "slurmd")}
    deadline = time.monotonic() + 60
    state = ""
    while time.monotonic() < deadline:
        state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True).stdout.strip()
        if state in ("idle", "mix", "alloc"):
            break
        time.sleep(0.5)
    else:
        message = not_up(f"the private Slurm's node (sinfo: {state or 'no answer'})", daemons, root)
        for daemon in daemons.values():
            daemon.kill()
            daemon.wait(10)
        if started_munge:
            _stop_munge()
        shutil.rmtree(root, ignore_errors=True)
        pytest.fail(message)
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)
    yield env
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old
    for daemon in daemons.values():
        daemon.terminate()
        daemon.wait(10)
    shutil.rmtree(root, ignore_errors=True)
    if started_munge:
        _stop_munge()


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def runtime(tmp_path: Path, steps: list[list[str]]) -> Runtime:
    tmp_path.mkdir(parents=True, exist_ok=True)
    store = Store(tmp_path / "db.sqlite")
    store.create_token("alice")
    return Runtime(store, SlurmLauncher(tmp_path / "jobs"), lambda job, attempt, guests: steps, grace_s=0.5)


def submit(rt: Runtime):
    job, _ = rt.store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model="x.y:z", batch=8))
    return job


def test_a_job_runs_as_a_slurm_batch_job_and_succeeds(slurm, tmp_path: Path) -> None:
    rt = runtime(tmp_path, [python("import os; print('on slurm', os.environ['SLURM_JOB_ID'])")])
    job = submit(rt)
    rt.start(job, "granted")
    assert rt.launcher.slurm_id(job.id, 1) is not None
    done = settle(rt, job.id, lambda j: j.state.terminal, timeout_s=120)
    assert done.state is JobStatus.SUCCEEDED, rt.launcher.files(job.id, 1).log.read_text()
    assert "on slurm" in rt.launcher.files(job.id, 1).log.read_text()


def test_a_failing_slurm_job_fails_and_a_cancelled_one_is_stopped(slurm, tmp_path: Path) -> None:
    failing = runtime(tmp_path / "a", [python("import sys; sys.exit(4)")])
    job = submit(failing)
    failing.start(job, "granted")
    done = settle(failing, job.id, lambda j: j.state.terminal, timeout_s=120)
    assert done.state is JobStatus.FAILED and done.exit_code == 4
    sleeping = runtime(tmp_path / "b", [python("import time; time.sleep(300)")])
    job = submit(sleeping)
    sleeping.start(job, "granted")
    settle(sleeping, job.id, lambda j: j.state is JobStatus.RUNNING, timeout_s=120)
    sleeping.store.transition(job.id, JobStatus.CANCELLED, "cancelled by alice")
    sleeping.reconcile()
    deadline = time.monotonic() + 60
    while sleeping.launcher.alive(job.id, 1) and time.monotonic() < deadline:
        time.sleep(0.2)  # scancel is asynchronous: the batch job may show COMPLETING for a moment
    assert sleeping.launcher.observe(job.id, 1).phase not in (LaunchPhase.RUNNING, LaunchPhase.QUEUED)
    assert sleeping.store.job(job.id).state is JobStatus.CANCELLED


# -- jobs as their submitters' accounts (serve --job-user with --launcher slurm) --------------------------------
WHO = """
import os, pwd, sys
me = pwd.getpwuid(os.getuid()).pw_name
print('uid', os.getuid(), 'gid', os.getgid(), 'env', sorted(os.environ))
open('whoami', 'w').write(me)
print(me + '-log-secret')
for path in sys.argv[1:]:
    try:
        print('read', path, os.listdir(path) if os.path.isdir(path) else open(path, 'rb').read()[:100])
    except OSError as err:
        print('refused', type(err).__name__, path)
"""


def test_under_slurm_each_job_runs_as_its_submitters_account(slurm, monkeypatch: pytest.MonkeyPatch) -> None:
    """Root submits with ``sbatch --uid --gid``: alice's job runs (supervisor and all) as dpalice, cannot read
    the database or the server's environment; bob's cannot read her log, her folder or her attempt's files."""
    monkeypatch.setenv("DEEPPOOL_ADMIN_SECRET", "hunter2-admin")
    with accounts(ALICE, BOB):
        folder = job_folder()
        jobs, db = folder / "jobs", folder / "db.sqlite"
        store = Store(db)
        for name in (ALICE, BOB):
            store.create_token(name)
        rt = Runtime(store, SlurmLauncher(jobs), lambda job, attempt, guests: [python(WHO) + targets], grace_s=0.5,
                     run_as=RunAs(kind=RunAsKind.SUBMITTER))
        done = {}
        for owner in (ALICE, BOB):  # each reads the database, alice's log, folder and attempt files, the folder
            job, _ = store.submit(owner, JobRequest(kind=JobKind.FOREGROUND, model="x.y:z", batch=8))
            first = done.get(ALICE, job.id)
            targets = [str(path) for path in (db, jobs / f"job-{first}.log", jobs / f"job-{first}",
                                              jobs / f"job-{first}.1.d", jobs)]
            rt.start(job, "granted")
            done[owner] = settle(rt, job.id, lambda j: j.state.terminal, timeout_s=120).id
        logs = {owner: rt.launcher.files(job_id, 1).log.read_text() for owner, job_id in done.items()}
        for owner, job_id in done.items():
            account = pwd.getpwnam(owner)
            slurm_log = jobs / f"job-{job_id}.1.d" / "slurm.log"  # where Slurm itself says what went wrong
            assert store.job(job_id).state is JobStatus.SUCCEEDED, (logs[owner], slurm_log.read_text())
            assert f"uid {account.pw_uid} gid {account.pw_gid}" in logs[owner], logs[owner]
            whoami = jobs / f"job-{job_id}" / "whoami"
            assert whoami.read_text() == owner and whoami.stat().st_uid == account.pw_uid
            assert "hunter2" not in logs[owner] and "DEEPPOOL_ADMIN_SECRET" not in logs[owner]
            log = rt.launcher.files(job_id, 1).log  # hers alone (0600), in the server's folder; the server reads it
            assert log.stat().st_uid == account.pw_uid and log.stat().st_mode & 0o777 == 0o600
        assert f"refused PermissionError {db}" in logs[ALICE] and f"{ALICE}-log-secret" in logs[ALICE], logs[ALICE]
        assert logs[BOB].count("refused PermissionError") == 5 and "\nread " not in logs[BOB], logs[BOB]
        assert f"{ALICE}-log-secret" not in logs[BOB]
