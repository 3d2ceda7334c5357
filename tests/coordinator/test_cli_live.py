"""The coordinator's CLI against a live server: token, submit, jobs, logs, cancel, and the errors a user meets."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.coordinator.test_durability import REPO, start
from tests.entry import deeppool
from tests.net import free_port

pytestmark = pytest.mark.slow
MODEL = REPO / "examples" / "background_mlp.py"


def test_submit_jobs_logs_cancel(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    db, port = tmp_path / "deeppool.db", free_port()
    created = subprocess.run([sys.executable, "-m", "deeppool.cli", "token", "create", "alice", "--db", str(db)],
                             cwd=REPO, capture_output=True, text=True, check=True)
    token = created.stdout.strip().splitlines()[-1]  # alone on the last line
    server = start(db, port, paused=True)
    try:
        monkeypatch.setenv("DEEPPOOL_URL", f"http://127.0.0.1:{port}")
        monkeypatch.delenv("DEEPPOOL_TOKEN", raising=False)
        missing = deeppool(capsys, "jobs")
        assert missing.code == 2 and missing.stderr.startswith("error: no token")
        monkeypatch.setenv("DEEPPOOL_TOKEN", token)
        first = deeppool(capsys, "submit", "fg", str(MODEL), "--gpus", "2", "--batch", "16", "--key", "k1")
        again = deeppool(capsys, "submit", "fg", str(MODEL), "--gpus", "2", "--batch", "16", "--key", "k1")
        assert first.code == 0 and first.stdout.strip() == "job 1: fg PENDING" and again.stdout == first.stdout
        listed = deeppool(capsys, "jobs")
        assert listed.code == 0 and "1 jobs" in listed.stdout and "PENDING" in listed.stdout
        assert deeppool(capsys, "logs", "1").code == 0
        assert deeppool(capsys, "cancel", "1").stdout.strip() == "job 1: CANCELLED"
        twice = deeppool(capsys, "cancel", "1")
        assert twice.code == 2 and "HTTP 409" in twice.stderr and "already CANCELLED" in twice.stderr
        followed = deeppool(capsys, "logs", "1", "-f")  # a job that has ended: returns at once
        assert followed.code == 0
        monkeypatch.setenv("DEEPPOOL_TOKEN", "wrong")
        refused = deeppool(capsys, "jobs")
        assert refused.code == 2 and "HTTP 401" in refused.stderr
    finally:
        server.terminate()
        server.wait(10)
    monkeypatch.setenv("DEEPPOOL_TOKEN", token)
    down = deeppool(capsys, "jobs")
    assert down.code == 2 and "cannot reach the coordinator" in down.stderr and "Traceback" not in down.stderr
