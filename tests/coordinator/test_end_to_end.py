"""End to end on CPU: a foreground job with a burst plan on 2 slots and a background job in its idle windows."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from deeppool.coordinator.client import Client
from deeppool.coordinator.jobs import JobKind, JobRequest, JobStatus
from deeppool.coordinator.store import Store
from tests.coordinator.test_durability import start
from tests.net import free_port

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
FOREGROUND = REPO / "tests" / "coordinator" / "models" / "burst_cnn.py"
BACKGROUND = REPO / "examples" / "background_mlp.py"


def test_a_foreground_burst_job_hosts_a_background_job_and_both_finish(tmp_path: Path) -> None:
    db, port = tmp_path / "deeppool.db", free_port()
    store = Store(db)
    token = store.create_token("alice")
    # both queued before the server starts, so its first tick (before it serves) sees them together
    fg, _ = store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model=str(FOREGROUND), gpus=2, batch=64,
                                             steps=40, amplification=1.5))
    bg, _ = store.submit("alice", JobRequest(kind=JobKind.BACKGROUND, model=str(BACKGROUND), batch=8, steps=10))
    store.close()
    server = start(db, port, gpus=2, allow=(REPO,))
    try:
        client = Client(f"http://127.0.0.1:{port}", token)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            jobs = {job.id: job for job in client.jobs()}
            if jobs[fg.id].state.terminal and jobs[bg.id].state.terminal:
                break
            time.sleep(0.2)
        log = client.logs(fg.id).text
        assert jobs[fg.id].state is JobStatus.SUCCEEDED, log[-3000:]
        assert jobs[bg.id].state is JobStatus.SUCCEEDED and jobs[bg.id].host_id == fg.id, jobs[bg.id]
        assert "trained 10 steps" in jobs[bg.id].reason  # its steps, in its host's windows (lent once it planned)
        assert jobs[fg.id].progress == 1.0 and jobs[bg.id].progress == 1.0
        assert client.cluster()["allocated"] == 0
    finally:
        server.terminate()
        server.wait(10)
