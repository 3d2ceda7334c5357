"""The status page in a real headless Chromium (Debian's package, installed here when missing)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from deeppool.coordinator.jobs import JobKind, JobRequest, JobStatus
from deeppool.coordinator.store import Store
from tests.coordinator.test_durability import start
from tests.net import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def chromium() -> str:
    """Chromium's path; installed with apt-get when missing and possible, else the test is skipped with why."""
    found = shutil.which("chromium")
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("chromium is not installed, and apt-get is not available to root here to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    done = subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], env=env, capture_output=True, text=True,
                          timeout=600)
    if done.returncode != 0 or shutil.which("chromium") is None:
        pytest.skip(f"apt-get could not install chromium: {done.stderr.strip()[-300:]}")
    return str(shutil.which("chromium"))


def headless(chromium: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", *args], capture_output=True,
                          text=True, timeout=120)


def test_the_status_page_renders_jobs_and_the_timeline(chromium: str, tmp_path: Path) -> None:
    db, port = tmp_path / "deeppool.db", free_port()
    store = Store(db)
    store.create_token("alice")
    host, _ = store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model="x.y:z", gpus=2, batch=8))
    guest, _ = store.submit("alice", JobRequest(kind=JobKind.BACKGROUND, model="x.y:z", batch=8))
    store.transition(host.id, JobStatus.STARTING, "granted")
    store.transition(guest.id, JobStatus.STARTING, "lent", host_id=host.id)
    store.transition(host.id, JobStatus.RUNNING, "running")
    store.transition(guest.id, JobStatus.RUNNING, "running")
    store.transition(host.id, JobStatus.FAILED, "exited with code 1")
    store.close()
    server = start(db, port, gpus=4, paused=True)  # paused: the jobs stay as written
    try:
        url = f"http://127.0.0.1:{port}/"
        dom = headless(chromium, "--dump-dom", url).stdout
        shot = tmp_path / "status.png"
        headless(chromium, f"--screenshot={shot}", "--window-size=1000,700", url)
    finally:
        server.terminate()
        server.wait(10)
    assert "2 jobs" in dom and "FAILED" in dom
    assert "requeued" in dom  # the server settled the guest of the failed host before serving: back in the queue
    assert dom.count("<rect") >= 2  # the host's GPUs and the guest's band
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
