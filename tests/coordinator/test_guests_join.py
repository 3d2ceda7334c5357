"""Background jobs join and leave a running foreground job (real server, real ranks, CPU ``gate`` mode).

A foreground job with a burst plan on 2 slots leaves rank 1 idle while its head runs. Background jobs are
submitted only once it runs: the next tick lends them that rank, its ranks pick the loan up at a step
boundary and start the guest's process; a guest that trains its steps SUCCEEDED while its host trains on, a
guest cancelled leaves it, and the host succeeds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from deeppool.coordinator.client import Client
from deeppool.coordinator.jobs import Job, JobKind, JobRequest, JobStatus
from deeppool.coordinator.store import Store
from tests.coordinator.test_durability import start
from tests.net import free_port

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # 40 s to 3 min with the load: a 400-step host outlives two guests
REPO = Path(__file__).resolve().parents[2]
FOREGROUND = REPO / "tests" / "coordinator" / "models" / "burst_cnn.py"
BACKGROUND = REPO / "examples" / "background_mlp.py"


def wait(client: Client, done: Callable[[dict[int, Job]], bool], timeout_s: float, db: Path) -> dict[int, Job]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        jobs = {job.id: job for job in client.jobs()}
        if done(jobs):
            return jobs
        time.sleep(0.2)
    raise AssertionError(f"timed out: {history(db)}")


def history(db: Path) -> str:
    store = Store(db)
    try:
        return "\n".join(f"job {job.id} {job.state.value}: " + "; ".join(
            f"{e.from_state} -> {e.to_state}: {e.reason}" for e in store.events(job.id)) for job in store.jobs())
    finally:
        store.close()


def test_a_background_job_joins_a_running_host_and_a_cancelled_one_leaves_it(tmp_path: Path) -> None:
    db, port = tmp_path / "deeppool.db", free_port()
    store = Store(db)
    token = store.create_token("alice")
    store.close()
    server = start(db, port, gpus=2, allow=(REPO,))
    try:
        client = Client(f"http://127.0.0.1:{port}", token)
        host = client.submit(JobRequest(kind=JobKind.FOREGROUND, model=str(FOREGROUND), gpus=2, batch=64,
                                        steps=400, amplification=1.5))
        wait(client, lambda jobs: jobs[host.id].state is JobStatus.RUNNING, 120, db)
        finishing = client.submit(JobRequest(kind=JobKind.BACKGROUND, model=str(BACKGROUND), batch=8, steps=20))
        jobs = wait(client, lambda jobs: jobs[finishing.id].state.terminal, 300, db)
        assert jobs[finishing.id].state is JobStatus.SUCCEEDED, history(db)
        assert jobs[finishing.id].host_id == host.id and jobs[finishing.id].progress == 1.0
        assert "trained 20 steps" in jobs[finishing.id].reason
        assert jobs[host.id].state is JobStatus.RUNNING, history(db)  # the guest left; its host trains on

        leaving = client.submit(JobRequest(kind=JobKind.BACKGROUND, model=str(BACKGROUND), batch=8, steps=100_000))
        wait(client, lambda jobs: jobs[leaving.id].state is JobStatus.RUNNING and jobs[leaving.id].progress > 0,
             300, db)
        client.cancel(leaving.id)
        jobs = wait(client, lambda jobs: jobs[host.id].state.terminal, 600, db)
        assert jobs[host.id].state is JobStatus.SUCCEEDED and jobs[host.id].progress == 1.0, history(db)
        assert jobs[leaving.id].state is JobStatus.CANCELLED
        summary = (client.logs(host.id).text, history(db))
        assert client.cluster()["allocated"] == 0, summary
    finally:
        server.terminate()
        server.wait(10)


