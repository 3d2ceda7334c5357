"""Issue 44, item 4: per-user quotas (429 with one line) and a history that ticks and ``/metrics`` never read.

The counters the database keeps match a full count (and an older database gets them from its jobs); a tick and
``/metrics`` query no finished job; ``serve`` refuses quotas and timeouts that cannot hold.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from deeppool.coordinator.app import RateLimit, ServerSettings, create_app
from deeppool.coordinator.jobs import JobKind, JobRequest, JobStatus
from deeppool.coordinator.launcher import LocalLauncher
from deeppool.coordinator.runtime import Runtime
from deeppool.coordinator.service import Service
from deeppool.coordinator.store import Store
from deeppool.scheduling import Order, Placement, Scheduler

REPO = Path(__file__).resolve().parents[2]
JOB = {"kind": "bg", "model": "examples.mlp:model", "batch": 8, "input_shape": [16]}


def client(tmp_path: Path, **limits: int) -> tuple[TestClient, Store, dict[str, str], dict[str, str]]:
    store = Store(tmp_path / "db.sqlite")
    alice, bob = store.create_token("alice"), store.create_token("bob")
    http = TestClient(create_app(store, ServerSettings(gpus=2, allowed_roots=(REPO / "examples",),
                                                       log_dir=tmp_path, **limits)))
    return http, store, {"Authorization": f"Bearer {alice}"}, {"Authorization": f"Bearer {bob}"}


def test_a_user_with_too_many_jobs_waiting_gets_429_and_others_do_not(tmp_path: Path) -> None:
    http, store, alice, bob = client(tmp_path, max_pending=3, submits_per_minute=0)
    for n in range(3):
        assert http.post("/v1/jobs", json={**JOB, "idempotency_key": f"k{n}"}, headers=alice).status_code == 201
    refused = http.post("/v1/jobs", json=JOB, headers=alice)
    assert refused.status_code == 429 and "--max-pending" in refused.json()["detail"]
    assert len(refused.json()["detail"].splitlines()) == 1
    again = http.post("/v1/jobs", json={**JOB, "idempotency_key": "k0"}, headers=alice)
    assert again.status_code == 200 and again.json()["id"] == 1  # a retried submission is no new job
    assert http.post("/v1/jobs", json=JOB, headers=bob).status_code == 201  # per user
    store.transition(1, JobStatus.CANCELLED, "cancelled by its owner")
    assert http.post("/v1/jobs", json=JOB, headers=alice).status_code == 201  # room again


def test_a_user_submitting_too_fast_gets_429_with_when_to_retry(tmp_path: Path) -> None:
    http, _, alice, bob = client(tmp_path, max_pending=0, submits_per_minute=5)
    codes = [http.post("/v1/jobs", json=JOB, headers=alice).status_code for _ in range(7)]
    assert codes == [201] * 5 + [429] * 2
    refused = http.post("/v1/jobs", json=JOB, headers=alice)
    assert "--max-submits-per-minute" in refused.json()["detail"] and int(refused.headers["Retry-After"]) >= 1
    assert http.post("/v1/jobs", json=JOB, headers=bob).status_code == 201
    bucket = RateLimit(60)  # one a second refills
    assert all(bucket.take("a") == 0 for _ in range(60)) and bucket.take("a") > 0
    time.sleep(1.1)
    assert bucket.take("a") == 0


def test_ticks_and_metrics_read_the_counters_not_the_history(tmp_path: Path) -> None:
    http, store, _, _ = client(tmp_path)
    for n in range(6):
        store.submit("alice", JobRequest(kind=JobKind.BACKGROUND if n % 2 else JobKind.FOREGROUND,
                                         model="examples.mlp:model", gpus=1, batch=8, input_shape=(16,)))
    for job_id, end in ((1, JobStatus.SUCCEEDED), (2, JobStatus.FAILED)):
        store.transition(job_id, JobStatus.STARTING, "t")
        store.transition(job_id, JobStatus.RUNNING, "t")
        store.transition(job_id, end, "t")
    store.transition(3, JobStatus.CANCELLED, "cancelled by its owner")
    counted = {key: n for key, n in store.counts().items() if n}
    assert counted == {(JobStatus.SUCCEEDED, JobKind.FOREGROUND): 1, (JobStatus.FAILED, JobKind.BACKGROUND): 1,
                       (JobStatus.CANCELLED, JobKind.FOREGROUND): 1, (JobStatus.PENDING, JobKind.BACKGROUND): 2,
                       (JobStatus.PENDING, JobKind.FOREGROUND): 1}
    with sqlite3.connect(tmp_path / "db.sqlite") as raw:  # the counters match the table, by a full count
        full = {(s, k): n for s, k, n in raw.execute("SELECT state, kind, COUNT(*) FROM jobs GROUP BY 1, 2")}
    assert {(s.value, k.value): n for (s, k), n in counted.items()} == full
    text = http.get("/metrics").text
    assert 'deeppool_jobs{kind="fg",state="SUCCEEDED"} 1.0' in text and "deeppool_queue_length 3.0" in text
    # a tick reads no finished job: hide them from every query but the counters'
    service = Service(Runtime(store, LocalLauncher(tmp_path / "jobs"), lambda job, attempt, guests: [["true"]]),
                      Scheduler(order=Order.FIFO_BACKFILL, placement=Placement.BURST_BG), 0)
    service.tick()  # the cancelled job had never started: settled, and no later tick looks at it
    assert store.unsettled() == []
    seen: list[str] = []
    store._db.set_trace_callback(seen.append)
    try:
        service.tick()
        http.get("/metrics")
    finally:
        store._db.set_trace_callback(None)
    reads = [sql for sql in seen if "FROM jobs" in sql]
    assert reads and all("state IN" in sql or "state = " in sql or "WHERE id = " in sql for sql in reads), reads


def test_an_older_database_gets_its_counters_from_its_jobs(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    store.create_token("alice")
    for _ in range(3):
        store.submit("alice", JobRequest(kind=JobKind.BACKGROUND, model="examples.mlp:model", batch=8,
                                         input_shape=(16,)))
    store.close()
    with sqlite3.connect(tmp_path / "db.sqlite") as raw:  # as a database from before the counters
        raw.execute("DROP TABLE job_counts")
        raw.execute("DROP TRIGGER job_counts_insert")
        raw.execute("DROP TRIGGER job_counts_move")
    store = Store(tmp_path / "db.sqlite")
    assert store.count() == 3 and store.counts()[(JobStatus.PENDING, JobKind.BACKGROUND)] == 3


def test_serve_refuses_limits_that_cannot_hold_with_one_line(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from tests.entry import deeppool

    for flag, value, says in (("--max-pending", "-1", "0 (no limit) or more"),
                              ("--max-submits-per-minute", "-5", "0 (no limit) or more"),
                              ("--max-client-connections", "0", "more than 0"),
                              ("--head-timeout-s", "0", "more than 0"), ("--body-timeout-s", "-1", "more than 0")):
        refused = deeppool(capsys, "serve", "--db", str(tmp_path / "d.db"), "--paused", flag, value)
        assert refused.code == 2 and refused.stderr.startswith(f"error: {flag} {value}") and says in refused.stderr
        assert len(refused.stderr.splitlines()) == 1
    assert not list(tmp_path.iterdir())  # nothing was created
