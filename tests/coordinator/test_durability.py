"""A real server (`deeppool serve`, uvicorn, SQLite on disk) killed with SIGKILL under concurrent submissions."""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from deeppool.coordinator.jobs import JobKind, JobRequest, JobStatus
from deeppool.coordinator.store import Store
from tests.coordinator.accounts import JOB_ACCOUNT, job_folder
from tests.net import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
JOB = {"kind": "fg", "gpus": 4, "model": "examples.mlp:model", "input_shape": [16], "batch": 8}



def start(db: Path, port: int, *, gpus: int = 4, allow: tuple[Path, ...] = (REPO / "examples",),
          paused: bool = False, env: dict[str, str] | None = None, wait: bool = True,
          options: tuple[str, ...] = (), logs: Path | None = None, job_user: bool = True) -> subprocess.Popen:
    """``deeppool serve`` on ``port``; ``options``: more of its flags.

    As root (and ``job_user``), its jobs run as the tests' job account, their files in ``logs`` (default: a
    fresh folder that account can reach).
    """
    roots = [arg for root in allow for arg in ("--allow", str(root))]
    if os.geteuid() == 0 and job_user:
        options = ("--job-user", JOB_ACCOUNT, "--log-dir", str(logs or job_folder()), *options)
    elif logs is not None:
        options = ("--log-dir", str(logs), *options)
    proc = subprocess.Popen([sys.executable, "-m", "deeppool.cli", "serve", "--db", str(db), "--port", str(port),
                             "--gpus", str(gpus), *roots, *(["--paused"] if paused else []), *options], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})
    if not wait:
        return proc
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"server did not start: {proc.stderr.read().decode()[-2000:]}")


def token(db: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "deeppool.cli", "token", "create", "alice", "--db", str(db)],
                         cwd=REPO, capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def submitter(port: int, token: str, prefix: str, acked: dict[str, int], stop: threading.Event) -> None:
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"},
                        timeout=5)
    for i in range(10_000):
        if stop.is_set():
            return
        key = f"{prefix}-{i}"
        try:
            response = http.post("/v1/jobs", json={**JOB, "idempotency_key": key})
        except httpx.TransportError:
            return  # the server died mid-request: not acknowledged
        if response.status_code in (200, 201):
            acked[key] = response.json()["id"]


@pytest.mark.parametrize("seed", [0, 1])
def test_every_acknowledged_job_survives_kill_9(tmp_path: Path, seed: int) -> None:
    db, port = tmp_path / "deeppool.db", free_port()
    secret = token(db)
    server = start(db, port, paused=True)  # queued, never launched: the database alone is under test
    acked: dict[str, int] = {}
    stop = threading.Event()
    threads = [threading.Thread(target=submitter, args=(port, secret, f"t{n}", acked, stop)) for n in range(4)]
    for t in threads:
        t.start()
    time.sleep(random.Random(seed).uniform(0.5, 2.0))
    os.kill(server.pid, signal.SIGKILL)
    server.wait()
    stop.set()
    for t in threads:
        t.join()
    assert len(acked) > 10
    store = Store(db)
    assert store.integrity() == "ok"
    jobs = {job.id: job for job in store.jobs()}
    assert all(acked_id in jobs for acked_id in acked.values())  # nothing acknowledged was lost
    store.close()
    with sqlite3.connect(db) as raw:
        keys = [key for (key,) in raw.execute("SELECT idempotency_key FROM jobs")]
        orphans = raw.execute("SELECT COUNT(*) FROM jobs WHERE id NOT IN (SELECT job_id FROM events)").fetchone()[0]
    assert len(keys) == len(set(keys)) == len(jobs)  # one job per key: none made twice
    assert orphans == 0  # every job has its submission event: both were written in one transaction
    restarted = start(db, port, paused=True)
    try:
        again = httpx.post(f"http://127.0.0.1:{port}/v1/jobs", headers={"Authorization": f"Bearer {secret}"},
                           json={**JOB, "idempotency_key": next(iter(acked))})
        assert again.status_code == 200 and again.json()["id"] == acked[next(iter(acked))]  # the key still holds
    finally:
        restarted.terminate()
        restarted.wait(10)


def test_a_crash_between_commit_and_launch_runs_the_job_once_after_restart(tmp_path: Path) -> None:
    db, port = tmp_path / "deeppool.db", free_port()
    store = Store(db)
    store.create_token("alice")
    job, _ = store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model=str(REPO / "examples" / "background_mlp.py"),
                                              gpus=1, batch=8, steps=3))
    store.close()
    logs = job_folder()
    crashing = start(db, port, env={"DEEPPOOL_FAULT": "crash-after-claim"}, wait=False, logs=logs)
    assert crashing.wait(60) == 137  # died right after committing the claim, before launching
    store = Store(db)
    assert store.job(job.id).state is JobStatus.STARTING and store.attempts(job.id) == 1
    store.close()
    server = start(db, port, logs=logs)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            store = Store(db)
            state = store.job(job.id).state
            store.close()
            if state.terminal:
                break
            time.sleep(0.5)
    finally:
        server.terminate()
        server.wait(10)
    log = (logs / f"job-{job.id}.log").read_text()
    assert state is JobStatus.SUCCEEDED, log[-2000:]
    assert log.count("coordinator.driver") == 1  # launched once, by the restarted server
