"""The coordinator's state: jobs, their event log and API tokens, in embedded SQLite.

The database runs in WAL mode with ``synchronous=FULL``: a write returns only
after it is on disk, so a job the server has acknowledged survives ``kill -9``.
Every write is one ``BEGIN IMMEDIATE`` transaction. A state change is a
compare-and-swap (``UPDATE … WHERE id = ? AND state IN (sources)``) against
:data:`~deeppool.coordinator.jobs.TRANSITIONS`, written in the same
transaction as its row in the append-only ``events`` table. What a running
job reports without changing state (a straggler, a policy's request for
other GPUs) is an event from and to its current state (:meth:`Store.note`). A submission with
an idempotency key its owner has used before returns the first job instead of
a new one (a unique index, so two racing submissions still make one job).
Tokens are stored only as their SHA-256.

The file is checked (``PRAGMA quick_check``) when it is opened, so a damaged
database is one message, not a failure later. One server at a time uses a
database: :func:`lock_database` holds an exclusive ``flock`` on ``DB.lock``
beside it for as long as the server runs.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import os
import secrets
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

from deeppool.coordinator.isolation import private_file
from deeppool.coordinator.jobs import Job, JobEvent, JobKind, JobRequest, JobStatus, sources
from deeppool.errors import DeeppoolError

SCHEMA = """
CREATE TABLE IF NOT EXISTS users (
    name TEXT PRIMARY KEY,
    token_sha256 TEXT NOT NULL UNIQUE,
    created_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    owner TEXT NOT NULL REFERENCES users(name),
    kind TEXT NOT NULL,
    state TEXT NOT NULL,
    model TEXT NOT NULL,
    gpus INTEGER NOT NULL,
    batch INTEGER NOT NULL,
    steps INTEGER NOT NULL,
    amplification REAL,
    idempotency_key TEXT,
    reason TEXT,
    exit_code INTEGER,
    progress REAL NOT NULL DEFAULT 0,
    host_id INTEGER REFERENCES jobs(id),
    script TEXT,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL
);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency ON jobs(owner, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id INTEGER NOT NULL REFERENCES jobs(id),
    from_state TEXT,
    to_state TEXT NOT NULL,
    reason TEXT NOT NULL,
    at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_job ON events(job_id);
CREATE INDEX IF NOT EXISTS events_moves ON events(job_id, to_state) WHERE from_state IS NOT to_state;
CREATE TRIGGER IF NOT EXISTS events_append_only BEFORE UPDATE ON events
    BEGIN SELECT RAISE(ABORT, 'events are append-only'); END;
CREATE TRIGGER IF NOT EXISTS events_no_delete BEFORE DELETE ON events
    BEGIN SELECT RAISE(ABORT, 'events are append-only'); END;
"""


COLUMNS_SINCE_V1 = {"input_shape": "TEXT", "input_dtype": "TEXT", "vocab_size": "INTEGER", "script": "TEXT"}
"""Columns added to ``jobs`` after the first schema: a database from before gets them when it is opened."""
MOVES = "from_state IS NOT to_state"
"""The events that move a job (its submission included), as the partial index ``events_moves`` holds them."""


def _now() -> str:
    return datetime.now(UTC).isoformat()


def check_user_name(name: str) -> None:
    if not name or len(name) > 64 or not name.replace("-", "").replace("_", "").isalnum():
        raise DeeppoolError(f"user name '{name}' must be 1 to 64 letters, digits, '-' or '_'")


def check_path(path: Path) -> None:
    """Refuse a ``--db`` that cannot be a database file (before anything is created)."""
    if path.exists() and path.is_dir():
        raise DeeppoolError(f"--db '{path}' is a directory: give a database file, e.g. deeppool.db")
    if not path.parent.exists():
        raise DeeppoolError(f"--db '{path}': folder '{path.parent}' does not exist")


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Store:
    """One database file; safe to share between the server's threads (writes are serialised)."""

    def __init__(self, path: Path) -> None:
        check_path(path)
        self.path = path
        self._lock = threading.Lock()
        try:
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        except sqlite3.DatabaseError as err:
            raise DeeppoolError(f"--db '{path}' cannot be opened ({err})") from None
        try:
            self._open()
        except (sqlite3.DatabaseError, DeeppoolError) as err:
            self._db.close()
            if isinstance(err, DeeppoolError):
                raise
            raise DeeppoolError(f"--db '{path}' is not a deeppool database, or is damaged ({err}): restore it "
                                "from a backup, or give another --db") from None
        private_file(path)  # readable by the server's user only (SQLite gives its -wal and -shm the same mode)

    def _open(self) -> None:
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        damage = str(self._db.execute("PRAGMA quick_check").fetchone()[0])
        if damage != "ok":
            raise DeeppoolError(f"--db '{self.path}' is damaged ({damage.splitlines()[0]}): restore it from a "
                                "backup (sqlite3's .recover saves what it can)")
        self._db.executescript(SCHEMA)
        known = {row["name"] for row in self._db.execute("PRAGMA table_info(jobs)")}
        for column, kind in COLUMNS_SINCE_V1.items():
            if column not in known:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {kind}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _read(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- tokens ----------------------------------------------------------------------------------
    def create_token(self, name: str) -> str:
        """A new token for ``name`` (replacing any earlier one); only its hash is kept."""
        check_user_name(name)
        token = secrets.token_urlsafe(32)
        with self._write() as db:
            db.execute("INSERT INTO users(name, token_sha256, created_at) VALUES (?, ?, ?) "
                       "ON CONFLICT(name) DO UPDATE SET token_sha256 = excluded.token_sha256",
                       (name, token_hash(token), _now()))
        return token

    def user(self, token: str) -> str | None:
        """The user a token belongs to, compared in constant time; None for an unknown token."""
        digest = token_hash(token)
        rows = self._read("SELECT name, token_sha256 FROM users WHERE token_sha256 = ?", (digest,))
        for row in rows:
            if hmac.compare_digest(row["token_sha256"], digest):
                return str(row["name"])
        return None

    # -- jobs ------------------------------------------------------------------------------------
    def submit(self, owner: str, request: JobRequest) -> tuple[Job, bool]:
        """The job for this request, and whether it is new (False: an earlier one with the same key)."""
        now = _now()
        gpus = request.gpus if request.kind is JobKind.FOREGROUND else 1
        with self._write() as db:
            if request.idempotency_key is not None:
                row = db.execute("SELECT * FROM jobs WHERE owner = ? AND idempotency_key = ?",
                                 (owner, request.idempotency_key)).fetchone()
                if row is not None:
                    return _job(row), False
            shape = json.dumps(list(request.input_shape)) if request.input_shape is not None else None
            cursor = db.execute(
                "INSERT INTO jobs(owner, kind, state, model, gpus, batch, steps, amplification, input_shape, "
                "input_dtype, vocab_size, idempotency_key, script, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (owner, request.kind.value, JobStatus.PENDING.value, request.model, gpus, request.batch,
                 request.steps, request.amplification, shape, request.input_dtype, request.vocab_size,
                 request.idempotency_key, request.script, now, now))
            job_id = int(cursor.lastrowid)
            db.execute("INSERT INTO events(job_id, from_state, to_state, reason, at) VALUES (?, NULL, ?, ?, ?)",
                       (job_id, JobStatus.PENDING.value, "submitted", now))
            row = db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _job(row), True

    def transition(self, job_id: int, target: JobStatus, reason: str, *, exit_code: int | None = None,
                   host_id: int | None = None) -> bool:
        """Move the job to ``target`` if that is legal from its current state (atomically); whether it moved.

        ``host_id`` names the foreground job whose idle windows a background job starts in (moves to
        STARTING); a move back to PENDING clears it.
        """
        allowed = sorted(state.value for state in sources(target))
        if not allowed:
            return False
        now = _now()
        marks = ",".join("?" * len(allowed))
        with self._write() as db:
            row = db.execute(f"SELECT state FROM jobs WHERE id = ? AND state IN ({marks})",
                             (job_id, *allowed)).fetchone()
            if row is None:
                return False
            host = "?" if target in (JobStatus.STARTING, JobStatus.PENDING) else "host_id"
            changed = db.execute(
                f"UPDATE jobs SET state = ?, reason = ?, exit_code = COALESCE(?, exit_code), updated_at = ?, "
                f"host_id = {host} WHERE id = ? AND state IN ({marks})",
                (target.value, reason, exit_code, now, *([host_id] if host == "?" else []), job_id, *allowed)).rowcount
            if changed:
                db.execute("INSERT INTO events(job_id, from_state, to_state, reason, at) VALUES (?, ?, ?, ?, ?)",
                           (job_id, row["state"], target.value, reason, now))
        return bool(changed)

    def note(self, job_id: int, reasons: Sequence[str], *, prefix: str) -> int:
        """Append events that do not move the job (from and to its current state), each reason once.

        ``reasons`` is the whole list so far from one source (a run's ``events.jsonl``); the events whose
        reason starts with ``prefix`` say how many are in already, and only the rest are appended, in the
        same transaction. Returns how many were appended.
        """
        now = _now()
        with self._write() as db:
            row = db.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                return 0
            known = db.execute("SELECT COUNT(*) FROM events WHERE job_id = ? AND substr(reason, 1, ?) = ?",
                               (job_id, len(prefix), prefix)).fetchone()[0]
            new = [f"{prefix}{reason}" for reason in reasons[known:]]
            db.executemany("INSERT INTO events(job_id, from_state, to_state, reason, at) VALUES (?, ?, ?, ?, ?)",
                           [(job_id, row["state"], row["state"], reason, now) for reason in new])
        return len(new)

    def set_progress(self, job_id: int, progress: float) -> None:
        with self._write() as db:
            db.execute("UPDATE jobs SET progress = ?, updated_at = ? WHERE id = ?",
                       (min(1.0, max(0.0, progress)), _now(), job_id))

    def job(self, job_id: int) -> Job | None:
        rows = self._read("SELECT * FROM jobs WHERE id = ?", (job_id,))
        return _job(rows[0]) if rows else None

    def jobs(self, *, owner: str | None = None, states: tuple[JobStatus, ...] = (), host_id: int | None = None,
             after: int = 0, before: int | None = None, limit: int = -1, newest_first: bool = False) -> list[Job]:
        """The jobs that match, by id (``newest_first``: descending); a page: ids in (``after``, ``before``),
        at most ``limit`` (-1: all)."""
        clauses, args = ["id > ?"], [after]
        if before is not None:
            clauses.append("id < ?")
            args.append(before)
        if host_id is not None:
            clauses.append("host_id = ?")
            args.append(host_id)
        if owner is not None:
            clauses.append("owner = ?")
            args.append(owner)
        if states:
            clauses.append(f"state IN ({','.join('?' * len(states))})")
            args += [s.value for s in states]
        order = "DESC" if newest_first else "ASC"
        return [_job(row) for row in self._read(f"SELECT * FROM jobs WHERE {' AND '.join(clauses)} ORDER BY id {order} "
                                                "LIMIT ?", (*args, limit))]

    def count(self) -> int:
        return int(self._read("SELECT COUNT(*) FROM jobs")[0][0])

    def events(self, job_id: int) -> list[JobEvent]:
        rows = self._read("SELECT * FROM events WHERE job_id = ? ORDER BY id", (job_id,))
        return [_event(r) for r in rows]

    def moves(self, job_ids: Sequence[int]) -> dict[int, list[JobEvent]]:
        """Each job's events that moved it (no notes), in order: what a timeline needs, from an index."""
        found: dict[int, list[JobEvent]] = {job_id: [] for job_id in job_ids}
        for first in range(0, len(job_ids), 500):
            chunk = tuple(job_ids[first:first + 500])
            marks = ",".join("?" * len(chunk))
            rows = self._read(f"SELECT * FROM events INDEXED BY events_moves WHERE job_id IN ({marks}) AND {MOVES} "
                              "ORDER BY id", chunk)
            for row in rows:
                found[row["job_id"]].append(_event(row))
        return found

    def attempts(self, job_id: int) -> int:
        """How many times the job has been started (its moves into STARTING): the current attempt's number."""
        rows = self._read(f"SELECT COUNT(*) FROM events INDEXED BY events_moves WHERE job_id = ? AND to_state = ? "
                          f"AND {MOVES}", (job_id, JobStatus.STARTING.value))
        return int(rows[0][0])

    def integrity(self) -> str:
        return str(self._read("PRAGMA integrity_check")[0][0])


def lock_database(path: Path) -> IO[str]:
    """Hold ``path``'s server lock (an exclusive ``flock`` on ``PATH.lock``) while the returned file is open."""
    lock = path.with_name(path.name + ".lock")
    try:
        handle = lock.open("a+")
    except OSError as err:
        raise DeeppoolError(f"--db '{path}': cannot open its lock file '{lock}' ({err.strerror})") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise DeeppoolError(f"--db '{path}' is in use by another server ({holder}): stop it, or give another --db"
                            ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return handle


def _event(row: sqlite3.Row) -> JobEvent:
    return JobEvent(id=row["id"], job_id=row["job_id"], to_state=JobStatus(row["to_state"]), reason=row["reason"],
                    at=datetime.fromisoformat(row["at"]),
                    from_state=JobStatus(row["from_state"]) if row["from_state"] else None)


def _job(row: sqlite3.Row) -> Job:
    shape = row["input_shape"]
    return Job(id=row["id"], kind=JobKind(row["kind"]), state=JobStatus(row["state"]), owner=row["owner"],
               model=row["model"], gpus=row["gpus"], batch=row["batch"], steps=row["steps"],
               amplification=row["amplification"], input_shape=tuple(json.loads(shape)) if shape else None,
               input_dtype=row["input_dtype"], vocab_size=row["vocab_size"],
               created_at=datetime.fromisoformat(row["created_at"]),
               updated_at=datetime.fromisoformat(row["updated_at"]), reason=row["reason"],
               exit_code=row["exit_code"], progress=row["progress"], host_id=row["host_id"], script=row["script"])

