"""Ended jobs' files leave the jobs' folder after their time, or oldest first while its disk is short; running
jobs' files never do, and a log that is gone says why."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

from fastapi.testclient import TestClient

from deeppool.coordinator.app import ServerSettings, create_app
from deeppool.coordinator.jobs import Job, JobKind, JobRequest, JobStatus
from deeppool.coordinator.retention import REMOVED, Retention, disk_short, free_bytes, removed_reason, sweep
from deeppool.coordinator.store import Store

REPO = Path(__file__).resolve().parents[2]
KEEP_DAY = Retention(keep_s=86400, min_free_bytes=0)


def _store(tmp_path: Path) -> Store:
    store = Store(tmp_path / "db.sqlite")
    store.create_token("alice")
    return store


def _job(store: Store, folder: Path, *, end: JobStatus | None) -> Job:
    job, _ = store.submit("alice", JobRequest(kind=JobKind.BACKGROUND, model="examples.mlp:model", batch=8))
    for state in (JobStatus.STARTING, JobStatus.RUNNING, end) if end is not None else ():
        assert store.transition(job.id, state, "moved")
    (folder / f"job-{job.id}").mkdir(parents=True)
    (folder / f"job-{job.id}" / "checkpoint.pt").write_bytes(b"x" * 1024)
    (folder / f"job-{job.id}.log").write_text("step 1\n")
    (folder / f"job-{job.id}.1.exit").write_text("0\n")
    return store.job(job.id)


def _left(folder: Path) -> set[str]:
    return {path.name for path in folder.iterdir()}


def test_files_of_ended_jobs_past_their_time_are_removed_and_the_rest_kept(tmp_path: Path) -> None:
    store, folder = _store(tmp_path), tmp_path / "jobs"
    done = _job(store, folder, end=JobStatus.SUCCEEDED)
    failed = _job(store, folder, end=JobStatus.FAILED)
    waiting = _job(store, folder, end=None)
    cancelled = _job(store, folder, end=JobStatus.CANCELLED)  # not settled: a process of it may be left
    (folder / "state.json").write_text("{}")  # not a job's
    assert sweep(store, folder, KEEP_DAY).removed == ()  # none is a day old
    later = datetime.now(UTC) + timedelta(days=2)
    assert sweep(store, folder, KEEP_DAY, later).removed == (done.id, failed.id)
    assert _left(folder) == {"state.json", *(f"job-{j.id}{tail}" for j in (waiting, cancelled)
                                            for tail in ("", ".log", ".1.exit"))}
    assert removed_reason(store, done.id).startswith(f"{REMOVED}2.0 days after the job ended")
    assert removed_reason(store, waiting.id) is None
    store.settle(cancelled.id)
    assert sweep(store, folder, KEEP_DAY, later).removed == (cancelled.id,)
    assert sweep(store, folder, KEEP_DAY, later).removed == ()  # once; the event is not repeated
    assert [e.reason for e in store.events(done.id)].count(removed_reason(store, done.id)) == 1


def test_a_gone_log_says_why(tmp_path: Path) -> None:
    store, folder = _store(tmp_path), tmp_path / "jobs"
    done = _job(store, folder, end=JobStatus.SUCCEEDED)
    token = store.create_token("alice")  # a second token of hers
    http = TestClient(create_app(store, ServerSettings(gpus=2, allowed_roots=(REPO,), log_dir=folder)))
    auth = {"Authorization": f"Bearer {token}"}
    assert http.get(f"/v1/jobs/{done.id}/logs", headers=auth).text == "step 1\n"
    sweep(store, folder, KEEP_DAY, datetime.now(UTC) + timedelta(days=3))
    gone = http.get(f"/v1/jobs/{done.id}/logs", headers=auth)
    assert gone.status_code == 410 and "3.0 days after the job ended" in gone.json()["detail"], gone.text


def test_a_short_disk_removes_the_jobs_that_ended_first_and_healthz_says_so(tmp_path: Path) -> None:
    store, folder = _store(tmp_path), tmp_path / "jobs"
    first, second = (_job(store, folder, end=JobStatus.SUCCEEDED) for _ in range(2))
    running = _job(store, folder, end=None)
    short = Retention(keep_s=None, min_free_bytes=free_bytes(tmp_path) + (1 << 40))  # always short
    http = TestClient(create_app(store, ServerSettings(gpus=2, allowed_roots=(REPO,), log_dir=folder,
                                                       retention=short)))
    health = http.get("/healthz")
    assert health.status_code == 503 and "jobs' disk is short" in health.json()["detail"], health.text
    assert sweep(store, folder, short).removed == (first.id, second.id)  # ended first, removed first
    assert (folder / f"job-{running.id}" / "checkpoint.pt").exists()  # a live job's files never go
    assert "the jobs' disk was short" in removed_reason(store, first.id)
    assert disk_short(folder, Retention(keep_s=None, min_free_bytes=0)) is None
