"""The job store: legal moves only, as compare-and-swap; final terminal states; the event log; idempotency."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from deeppool.coordinator.jobs import TRANSITIONS, JobKind, JobRequest, JobStatus
from deeppool.coordinator.store import Store, token_hash
from deeppool.errors import DeeppoolError


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "db.sqlite")
    s.create_token("alice")
    return s


def request(key: str | None = None, kind: JobKind = JobKind.FOREGROUND) -> JobRequest:
    return JobRequest(kind=kind, model="examples.mlp:model", gpus=4, batch=64, idempotency_key=key)


def test_a_job_walks_the_legal_path_and_every_move_is_an_event(store: Store) -> None:
    job, new = store.submit("alice", request())
    assert new and job.state is JobStatus.PENDING
    for target in (JobStatus.STARTING, JobStatus.RUNNING, JobStatus.SUCCEEDED):
        assert store.transition(job.id, target, f"to {target.value}", exit_code=0 if target.terminal else None)
    assert store.job(job.id).state is JobStatus.SUCCEEDED and store.job(job.id).exit_code == 0
    events = store.events(job.id)
    assert [(e.from_state, e.to_state) for e in events] == [
        (None, JobStatus.PENDING), (JobStatus.PENDING, JobStatus.STARTING),
        (JobStatus.STARTING, JobStatus.RUNNING), (JobStatus.RUNNING, JobStatus.SUCCEEDED)]
    assert events[0].reason == "submitted"


@pytest.mark.parametrize("start", list(JobStatus))
def test_only_the_transition_table_moves_a_job(store: Store, start: JobStatus) -> None:
    for target in JobStatus:
        job, _ = store.submit("alice", request())
        path = {JobStatus.PENDING: [], JobStatus.STARTING: [JobStatus.STARTING],
                JobStatus.RUNNING: [JobStatus.STARTING, JobStatus.RUNNING],
                JobStatus.SUCCEEDED: [JobStatus.STARTING, JobStatus.RUNNING, JobStatus.SUCCEEDED],
                JobStatus.FAILED: [JobStatus.FAILED], JobStatus.CANCELLED: [JobStatus.CANCELLED]}[start]
        for step in path:
            assert store.transition(job.id, step, "setup")
        moved = store.transition(job.id, target, "probe")
        assert moved == (target in TRANSITIONS[start])
        assert store.job(job.id).state is (target if moved else start)
    if start.terminal:
        assert not TRANSITIONS[start]  # final


def test_racing_moves_succeed_once(store: Store) -> None:
    job, _ = store.submit("alice", request())
    results: list[bool] = []
    threads = [threading.Thread(target=lambda: results.append(store.transition(job.id, JobStatus.STARTING, "race")))
               for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(True) == 1
    assert len(store.events(job.id)) == 2


def test_the_same_key_gives_the_same_job_even_when_racing(store: Store) -> None:
    jobs = []
    threads = [threading.Thread(target=lambda: jobs.append(store.submit("alice", request("k1"))))
               for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({job.id for job, _ in jobs}) == 1 and sum(new for _, new in jobs) == 1
    store.create_token("bob")
    other, new = store.submit("bob", request("k1"))  # keys are per user
    assert new and other.id != jobs[0][0].id


def test_events_are_append_only(store: Store) -> None:
    job, _ = store.submit("alice", request())
    db = sqlite3.connect(store.path)
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        db.execute("UPDATE events SET reason = 'rewritten'")
    with pytest.raises(sqlite3.DatabaseError, match="append-only"):
        db.execute("DELETE FROM events")


def test_only_the_token_hash_is_stored(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    token = store.create_token("carol")
    assert store.user(token) == "carol" and store.user(token + "x") is None
    raw = (tmp_path / "db.sqlite").read_bytes() + (tmp_path / "db.sqlite-wal").read_bytes()
    assert token.encode() not in raw and token_hash(token).encode() in raw
    assert store.integrity() == "ok"


def test_bad_database_paths_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(DeeppoolError, match="is a directory"):
        Store(tmp_path)
    with pytest.raises(DeeppoolError, match="does not exist"):
        Store(tmp_path / "missing" / "db.sqlite")
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database at all" * 100)
    with pytest.raises(DeeppoolError, match="not a deeppool database"):
        Store(junk)


def test_a_damaged_database_is_one_error(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite"
    store = Store(path)
    store.create_token("alice")
    for _ in range(300):
        store.submit("alice", request())
    store.close()
    with path.open("r+b") as raw:
        raw.seek(2 * 4096)
        raw.write(bytes(2 * 4096))  # two zeroed pages
    with pytest.raises(DeeppoolError, match="is damaged") as refused:
        Store(path)
    assert "\n" not in str(refused.value)


def test_a_database_from_before_the_factory_inputs_gains_their_columns(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as old:
        old.executescript("""
            CREATE TABLE users (name TEXT PRIMARY KEY, token_sha256 TEXT NOT NULL UNIQUE, created_at TEXT NOT NULL);
            CREATE TABLE jobs (id INTEGER PRIMARY KEY AUTOINCREMENT, owner TEXT NOT NULL REFERENCES users(name),
                kind TEXT NOT NULL, state TEXT NOT NULL, model TEXT NOT NULL, gpus INTEGER NOT NULL,
                batch INTEGER NOT NULL, steps INTEGER NOT NULL, amplification REAL, idempotency_key TEXT,
                reason TEXT, exit_code INTEGER, progress REAL NOT NULL DEFAULT 0, host_id INTEGER REFERENCES jobs(id),
                created_at TEXT NOT NULL, updated_at TEXT NOT NULL);
            INSERT INTO users VALUES ('alice', 'x', '2026-01-01T00:00:00+00:00');
            INSERT INTO jobs(owner, kind, state, model, gpus, batch, steps, created_at, updated_at)
                VALUES ('alice', 'fg', 'PENDING', 'a.py', 2, 8, 10, '2026-01-01T00:00:00+00:00',
                        '2026-01-01T00:00:00+00:00');
        """)
    store = Store(path)
    [job] = store.jobs()
    assert job.model == "a.py" and job.input_shape is None
    new, _ = store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model="a.b:c", batch=8, input_shape=(3, 4),
                                              input_dtype="int64", vocab_size=10))
    assert (new.input_shape, new.input_dtype, new.vocab_size) == ((3, 4), "int64", 10)
