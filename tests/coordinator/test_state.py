"""One server per state (issue 44, failure 3): two servers on two databases in one folder never touch each
other's jobs, and a log folder holding one database's jobs is refused to another.

Real servers (``deeppool serve`` as root, ``--job-user submitter``), real accounts (``dpalice``, ``dpbob``).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from deeppool.coordinator.store import STATE_FILE, default_log_dir
from tests.coordinator.accounts import ALICE, BOB, shared_folder
from tests.coordinator.test_durability import REPO, start
from tests.net import free_port

pytestmark = pytest.mark.slow
SLEEPER = "print({said!r}, flush=True)\nimport time\ntime.sleep(600)\n"



def token(db: Path, name: str) -> str:
    out = subprocess.run([sys.executable, "-m", "deeppool.cli", "token", "create", name, "--db", str(db)],
                         cwd=REPO, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def wait_for(http: httpx.Client, job_id: int, state: str, timeout_s: float = 180) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        job = http.get(f"/v1/jobs/{job_id}").json()
        if job["state"] == state or time.monotonic() > deadline:
            return job
        time.sleep(0.2)


def log_of(http: httpx.Client, job_id: int) -> str:
    answer = http.get(f"/v1/jobs/{job_id}/logs")
    return answer.content.decode(errors="replace") if answer.status_code == 200 else ""


def gone(pid_file: Path, timeout_s: float = 60) -> bool:
    """Whether the supervisor named in ``pid_file`` (if any) is gone, waiting for it up to ``timeout_s``."""
    try:
        pid = pid_file.read_text().strip()
    except OSError:
        return True
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.2)
    return False


def test_two_servers_in_one_folder_never_touch_each_others_jobs(users) -> None:
    with shared_folder() as folder:
        models = folder / "models"
        models.mkdir(mode=0o755)
        for name, said in (("alice.py", "alice's secret 7f3a"), ("bob.py", "bob's own job")):
            (models / name).write_text(SLEEPER.format(said=said))
            (models / name).chmod(0o644)
        first, second = folder / "a.db", folder / "b.db"
        tokens = {ALICE: token(first, ALICE), BOB: token(second, BOB)}
        ports = free_port(), free_port()
        servers = [start(db, port, allow=(models,), job_user=False, options=("--job-user", "submitter"))
                   for db, port in zip((first, second), ports, strict=True)]
        clients: list[httpx.Client] = []
        try:
            a = httpx.Client(base_url=f"http://127.0.0.1:{ports[0]}", timeout=30,
                             headers={"Authorization": f"Bearer {tokens[ALICE]}"})
            b = httpx.Client(base_url=f"http://127.0.0.1:{ports[1]}", timeout=30,
                             headers={"Authorization": f"Bearer {tokens[BOB]}"})
            clients += [a, b]
            hers = a.post("/v1/jobs", json={"kind": "bg", "model": str(models / "alice.py"), "batch": 8}).json()
            assert wait_for(a, hers["id"], "RUNNING")["state"] == "RUNNING"
            deadline = time.monotonic() + 180
            while "secret" not in log_of(a, hers["id"]) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert "alice's secret 7f3a" in log_of(a, hers["id"]), a.get(f"/v1/jobs/{hers['id']}").json()
            his = b.post("/v1/jobs", json={"kind": "bg", "model": str(models / "bob.py"), "batch": 8}).json()
            assert his["id"] == hers["id"]  # the same job id on each server
            assert wait_for(b, his["id"], "RUNNING")["state"] == "RUNNING"
            deadline = time.monotonic() + 180
            while "bob's own job" not in log_of(b, his["id"]) and time.monotonic() < deadline:
                time.sleep(0.2)
            seen = log_of(b, his["id"])
            assert "bob's own job" in seen and "secret" not in seen, seen[-2000:]  # his own job ran, not hers
            assert b.post(f"/v1/jobs/{his['id']}/cancel").status_code == 200
            assert wait_for(b, his["id"], "CANCELLED")["state"] == "CANCELLED"
            time.sleep(2)  # a few ticks of both servers
            still = a.get(f"/v1/jobs/{hers['id']}").json()
            assert still["state"] == "RUNNING", still  # B's cancel never reached A
            logs = default_log_dir(first), default_log_dir(second)
            assert logs[0] != logs[1] and all((log / STATE_FILE).exists() for log in logs)
            pid = (logs[0] / f"job-{hers['id']}.1.pid").read_text().strip()
            assert Path(f"/proc/{pid}").exists()  # her supervisor is alive
        finally:
            for client in clients:  # every job cancelled, and gone, before the servers stop
                client.post("/v1/jobs/1/cancel")
            for db in (first, second):
                assert gone(default_log_dir(db) / "job-1.1.pid")
            for server in servers:
                server.terminate()
                server.wait(15)


def refused(proc: subprocess.Popen) -> bytes:
    """What a server that must be refused said (killed, and the test failed, if it serves instead)."""
    try:
        assert proc.wait(30) == 2
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.stderr.read()


def test_a_log_folder_holding_another_databases_jobs_is_refused(tmp_path: Path) -> None:
    logs = tmp_path / "jobs"
    first = start(tmp_path / "a.db", free_port(), paused=True, logs=logs, job_user=False)
    try:
        busy = start(tmp_path / "b.db", free_port(), paused=True, logs=logs, job_user=False, wait=False)
        assert b"is in use by another server" in refused(busy)
    finally:
        first.terminate()
        first.wait(15)
    other = start(tmp_path / "b.db", free_port(), paused=True, logs=logs, job_user=False, wait=False)
    assert b"holds the jobs of another database" in refused(other)
    again = start(tmp_path / "a.db", free_port(), paused=True, logs=logs, job_user=False)  # its own: served
    again.terminate()
    assert again.wait(15) is not None


def test_a_database_reached_through_a_link_is_still_locked(tmp_path: Path) -> None:
    db = tmp_path / "a.db"
    first = start(db, free_port(), paused=True, logs=tmp_path / "jobs", job_user=False)
    try:
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "a.db").symlink_to(db)
        second = start(tmp_path / "other" / "a.db", free_port(), paused=True, logs=tmp_path / "jobs2",
                       job_user=False, wait=False)
        assert b"is in use by another server" in refused(second)
    finally:
        first.terminate()
        first.wait(15)
