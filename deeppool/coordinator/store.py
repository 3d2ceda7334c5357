"""The coordinator's state: jobs, their event log and API tokens, in embedded SQLite.

The database runs in WAL mode with ``synchronous=FULL``: a write returns only
after it is on disk, so a job the server has acknowledged survives ``kill -9``.
Every write is one ``BEGIN IMMEDIATE`` transaction. A state change is a
compare-and-swap (``UPDATE … WHERE id = ? AND state IN (sources)``) against
:data:`~deeppool.coordinator.jobs.TRANSITIONS`, written in the same
transaction as its row in the append-only ``events`` table. What a running
job reports without changing state (a straggler, a policy's request for
other GPUs) is an event from and to its current state (:meth:`Store.note`);
so is a change of a waiting job's shape, progress or measured speeds, written
by the database's own triggers (:data:`WAITING_CHANGES`). A submission with
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
from deeppool.coordinator.jobs import (
    Job,
    JobEvent,
    JobKind,
    JobRequest,
    JobStatus,
    SpeedPoint,
    WidthChange,
    sources,
)
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
CREATE INDEX IF NOT EXISTS jobs_owner_state ON jobs(owner, state);
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


COLUMNS_SINCE_V1 = {"input_shape": "TEXT", "input_dtype": "TEXT", "vocab_size": "INTEGER", "script": "TEXT",
                    "settled": "INTEGER NOT NULL DEFAULT 0", "width": "INTEGER", "run_batch": "INTEGER",
                    "run_steps": "INTEGER", "run_gain": "REAL"}
"""Columns added to ``jobs`` after the first schema: a database from before gets them when it is opened."""
COUNTERS = """
CREATE TABLE IF NOT EXISTS job_counts (
    state TEXT NOT NULL,
    kind TEXT NOT NULL,
    n INTEGER NOT NULL,
    PRIMARY KEY (state, kind)
);
CREATE TRIGGER IF NOT EXISTS job_counts_insert AFTER INSERT ON jobs BEGIN
    UPDATE job_counts SET n = n + 1 WHERE state = new.state AND kind = new.kind;
END;
CREATE TRIGGER IF NOT EXISTS job_counts_move AFTER UPDATE OF state ON jobs WHEN old.state IS NOT new.state BEGIN
    UPDATE job_counts SET n = n - 1 WHERE state = old.state AND kind = old.kind;
    UPDATE job_counts SET n = n + 1 WHERE state = new.state AND kind = new.kind;
END;
CREATE INDEX IF NOT EXISTS jobs_unsettled ON jobs(id) WHERE state = 'CANCELLED' AND settled = 0;
"""
"""Jobs by state and kind, kept by triggers in the writes' own transactions (``/metrics`` and the page read
these, not the history); and the cancelled jobs not yet known to have no process left (a partial index)."""
ELASTIC = """
CREATE TABLE IF NOT EXISTS resizes (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id INTEGER NOT NULL REFERENCES jobs(id),
    from_gpus INTEGER NOT NULL,
    to_gpus INTEGER NOT NULL,
    from_batch INTEGER NOT NULL,
    to_batch INTEGER NOT NULL,
    from_steps INTEGER NOT NULL,
    from_gain REAL NOT NULL,
    phase TEXT NOT NULL,
    reason TEXT NOT NULL,
    asked_at REAL NOT NULL,
    steps_done INTEGER,
    checkpoint_s REAL,
    stop_s REAL,
    plan_s REAL,
    plan_cached INTEGER,
    restart_s REAL,
    relaunched_at REAL,
    attempt INTEGER
);
CREATE INDEX IF NOT EXISTS resizes_job ON resizes(job_id);
CREATE INDEX IF NOT EXISTS resizes_open ON resizes(id) WHERE phase IN ('STOPPING', 'RESTARTING');
CREATE TABLE IF NOT EXISTS speeds (
    job_id INTEGER NOT NULL REFERENCES jobs(id),
    gpus INTEGER NOT NULL,
    batch INTEGER NOT NULL,
    iteration_s REAL NOT NULL,
    steps INTEGER NOT NULL,
    gns REAL,
    PRIMARY KEY (job_id, gpus, batch)
);
"""
"""Elastic jobs: each resize with its phase and what each part cost (written durably before each step of it, so
a server killed mid-resize carries it on), and each job's measured speed per (GPUs, batch)."""
RESIZE_FIELDS = ("steps_done", "checkpoint_s", "stop_s", "plan_s", "plan_cached", "restart_s", "relaunched_at",
                 "attempt")
WAITING = ("id, kind, owner, model, gpus, width, batch, run_batch, steps, created_at, EXISTS (SELECT 1 FROM events "
           "INDEXED BY events_moves WHERE job_id = jobs.id AND to_state = 'STARTING' AND from_state IS NOT to_state)")
"""What the scheduler reads of a waiting job (:mod:`deeppool.coordinator.waiting`); the last column: whether it
was started before (requeued)."""
WaitingRow = tuple[int, str, str, str, int, int | None, int, int | None, int, str, int]
MOVES = "from_state IS NOT to_state"
"""The events that move a job (its submission included), as the partial index ``events_moves`` holds them."""
CHANGED_WAITING = "changed while waiting: "
"""The reason's prefix of the events the database writes when what the scheduler reads of a waiting job changes
(:data:`WAITING_CHANGES`)."""
WAITING_CHANGES = f"""
CREATE TRIGGER IF NOT EXISTS waiting_reshaped AFTER UPDATE OF width, run_batch, run_steps, run_gain ON jobs
WHEN new.state = 'PENDING' AND (old.width IS NOT new.width OR old.run_batch IS NOT new.run_batch
                                OR old.run_steps IS NOT new.run_steps OR old.run_gain IS NOT new.run_gain) BEGIN
    INSERT INTO events(job_id, from_state, to_state, reason, at) VALUES (new.id, 'PENDING', 'PENDING',
        '{CHANGED_WAITING}its next attempt runs on ' || COALESCE(new.width, new.gpus) || ' GPUs at batch '
        || COALESCE(new.run_batch, new.batch), strftime('%Y-%m-%dT%H:%M:%f+00:00', 'now'));
END;
CREATE TRIGGER IF NOT EXISTS waiting_progress AFTER UPDATE OF progress ON jobs
WHEN new.state = 'PENDING' AND old.progress IS NOT new.progress BEGIN
    INSERT INTO events(job_id, from_state, to_state, reason, at) VALUES (new.id, 'PENDING', 'PENDING',
        '{CHANGED_WAITING}progress ' || new.progress, strftime('%Y-%m-%dT%H:%M:%f+00:00', 'now'));
END;
CREATE TRIGGER IF NOT EXISTS waiting_speed AFTER INSERT ON speeds
WHEN (SELECT state FROM jobs WHERE id = new.job_id) = 'PENDING' BEGIN
    INSERT INTO events(job_id, from_state, to_state, reason, at) VALUES (new.job_id, 'PENDING', 'PENDING',
        '{CHANGED_WAITING}a speed measured on ' || new.gpus || ' GPUs at batch ' || new.batch,
        strftime('%Y-%m-%dT%H:%M:%f+00:00', 'now'));
END;
CREATE TRIGGER IF NOT EXISTS waiting_speed_again AFTER UPDATE ON speeds
WHEN (SELECT state FROM jobs WHERE id = new.job_id) = 'PENDING' BEGIN
    INSERT INTO events(job_id, from_state, to_state, reason, at) VALUES (new.job_id, 'PENDING', 'PENDING',
        '{CHANGED_WAITING}a speed measured again on ' || new.gpus || ' GPUs at batch ' || new.batch,
        strftime('%Y-%m-%dT%H:%M:%f+00:00', 'now'));
END;
"""
"""A waiting job's shape (an elastic resize of it), progress and measured speeds change without moving it: the
database writes an event for each change, in the write's own transaction, so the waiting jobs the scheduler keeps
between ticks (:meth:`Store.moved_since`) and what it keeps of them (the speed models) see every change."""
CHANGES = f"{MOVES} OR substr(reason, 1, {len(CHANGED_WAITING)}) = '{CHANGED_WAITING}'"
"""The events :meth:`Store.moved_since` counts: the moves, and the changes of waiting jobs."""


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


class QuotaExceeded(DeeppoolError):
    """A submission past a per-user limit (the API answers 429 with this message)."""


RESERVE_BYTES = 8 << 20
"""Room the database keeps for its own commits: ``DB.reserve``, a file of this size taken at start (and again
once space returns), freed as soon as its file system has less than this left, so the server's own commits (a
job's end) still fit on a full disk. Submissions are refused (503) while it is freed."""


class DiskFull(DeeppoolError):
    """The database's file system is full: a one-line reason (the API answers 503 with it)."""


class Store:
    """One database file; safe to share between the server's threads (writes are serialised)."""

    def __init__(self, path: Path) -> None:
        check_path(path)
        self.path = path
        self.reserve = path.with_name(path.name + ".reserve")
        self._released = False  # the reserve was freed for a full disk, and not taken again yet
        self._lock = threading.Lock()
        self._take_reserve()
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
        self._db.executescript(ELASTIC)
        known = {row["name"] for row in self._db.execute("PRAGMA table_info(jobs)")}
        for column, kind in COLUMNS_SINCE_V1.items():
            if column not in known:
                self._db.execute(f"ALTER TABLE jobs ADD COLUMN {column} {kind}")
        self._db.executescript(WAITING_CHANGES)  # after the columns it reads
        self._make_counters()

    def _make_counters(self) -> None:
        """The job counters (:data:`COUNTERS`): made once, from the jobs there are (a database from before them)."""
        made = self._db.execute("SELECT COUNT(*) FROM sqlite_master WHERE name IN ('job_counts', 'job_counts_insert', "
                                "'job_counts_move', 'jobs_unsettled')").fetchone()[0]
        if made == 4 and self._db.execute("SELECT COUNT(*) FROM job_counts").fetchone()[0] == len(JobStatus) * len(
                JobKind):
            return  # the counters are there: opening writes nothing
        self._db.execute("BEGIN IMMEDIATE")
        try:
            new = self._db.execute("SELECT 1 FROM sqlite_master WHERE name = 'job_counts'").fetchone() is None
            for statement in _statements(COUNTERS):
                self._db.execute(statement)
            self._db.executemany("INSERT OR IGNORE INTO job_counts(state, kind, n) VALUES (?, ?, 0)",
                                 [(state.value, kind.value) for state in JobStatus for kind in JobKind])
            if new:
                self._db.execute("UPDATE job_counts SET n = (SELECT COUNT(*) FROM jobs WHERE jobs.state = "
                                 "job_counts.state AND jobs.kind = job_counts.kind)")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _free_bytes(self) -> int | None:
        try:
            info = os.statvfs(self.path.resolve().parent)
        except OSError:
            return None
        return info.f_bavail * info.f_frsize

    def _take_reserve(self) -> None:
        """Take the database's reserve (:data:`RESERVE_BYTES`) if it is not held and there is room for it."""
        if self.reserve.exists():
            return
        free = self._free_bytes()
        if free is None or free < 2 * RESERVE_BYTES:
            return
        try:
            fd = os.open(self.reserve, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError:
            return
        try:
            os.posix_fallocate(fd, 0, RESERVE_BYTES)
        except OSError:
            self.reserve.unlink(missing_ok=True)
        finally:
            os.close(fd)

    def space(self) -> str | None:
        """None while the database's file system has room; else a one-line reason. Past the reserve's size,
        the reserve is freed for the database's own commits; it is taken again once space returns."""
        free = self._free_bytes()
        if free is None:
            return None
        held = self.reserve.exists()
        if held and free < RESERVE_BYTES:
            self.reserve.unlink(missing_ok=True)  # the room it held is the database's now
            self._released, held = True, False
        elif not held:
            self._take_reserve()  # once there is room for it and as much again
            held = self.reserve.exists()
            self._released = self._released and not held
        if held or (not self._released and free >= RESERVE_BYTES):
            return None  # (a file system that cannot hold a reserve at all is full only when it is)
        return (f"the database's disk is full ({free >> 10} KiB free in {self.path.resolve().parent}): submissions "
                "wait until the operator frees space")

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        self.space()  # on a full disk, the reserve makes room for this commit
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

    def _tuples(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Rows as plain tuples (no :class:`sqlite3.Row`): for the reads a tick makes of every waiting job."""
        with self._lock:
            cursor = self._db.cursor()
            cursor.row_factory = None
            return cursor.execute(sql, args).fetchall()

    # -- tokens ----------------------------------------------------------------------------------
    def identity(self) -> str:
        """This database's own id: random, made once and kept in it (a server claims its log folder with it)."""
        with self._write() as db:
            db.execute("CREATE TABLE IF NOT EXISTS identity (id TEXT NOT NULL)")
            if db.execute("SELECT 1 FROM identity").fetchone() is None:
                db.execute("INSERT INTO identity(id) VALUES (?)", (secrets.token_hex(8),))
            return str(db.execute("SELECT id FROM identity").fetchone()[0])

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
    def submit(self, owner: str, request: JobRequest, *, max_pending: int = 0) -> tuple[Job, bool]:
        """The job for this request, and whether it is new (False: an earlier one with the same key).

        ``max_pending`` (0: no limit): a new job of an owner with that many waiting is refused
        (:class:`QuotaExceeded`), checked in the write's own transaction.
        """
        now = _now()
        gpus = request.gpus if request.kind is JobKind.FOREGROUND else 1
        with self._write() as db:
            if request.idempotency_key is not None:
                row = db.execute("SELECT * FROM jobs WHERE owner = ? AND idempotency_key = ?",
                                 (owner, request.idempotency_key)).fetchone()
                if row is not None:
                    return _job(row), False
            if max_pending > 0:
                waiting = db.execute("SELECT COUNT(*) FROM jobs INDEXED BY jobs_owner_state WHERE owner = ? AND "
                                     "state = ?", (owner, JobStatus.PENDING.value)).fetchone()[0]
                if waiting >= max_pending:
                    raise QuotaExceeded(f"you have {waiting} jobs waiting, the most one user may have (serve "
                                        "--max-pending): wait for some to start, or cancel some")
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

    def jobs_of(self, job_ids: Sequence[int]) -> list[Job]:
        """These jobs (those there are), by id: primary-key look-ups, 500 at a time."""
        found: list[Job] = []
        for first in range(0, len(job_ids), 500):
            chunk = tuple(job_ids[first:first + 500])
            found += [_job(row) for row in self._read(f"SELECT * FROM jobs WHERE id IN ({','.join('?' * len(chunk))})"
                                                      " ORDER BY id", chunk)]
        return found

    def scripts(self, job_ids: Sequence[int]) -> set[int]:
        """Which of these jobs run their own script (``script``), 500 at a time."""
        found: set[int] = set()
        for first in range(0, len(job_ids), 500):
            chunk = tuple(job_ids[first:first + 500])
            found.update(row[0] for row in self._tuples(
                f"SELECT id FROM jobs WHERE id IN ({','.join('?' * len(chunk))}) AND script IS NOT NULL", chunk))
        return found

    def count(self) -> int:
        """How many jobs there are (from the counters, not the history)."""
        return sum(self.counts().values())

    def counts(self) -> dict[tuple[JobStatus, JobKind], int]:
        """Jobs by state and kind, from the counters the database keeps (every pair, zeros included)."""
        return {(JobStatus(row["state"]), JobKind(row["kind"])): int(row["n"])
                for row in self._read("SELECT state, kind, n FROM job_counts")}

    def requeued(self) -> set[int]:
        """The waiting jobs that were started before (preempted, or their host ended): one indexed query."""
        rows = self._read(f"SELECT id FROM jobs WHERE state = ? AND EXISTS (SELECT 1 FROM events INDEXED BY "
                          f"events_moves WHERE job_id = jobs.id AND to_state = ? AND {MOVES})",
                          (JobStatus.PENDING.value, JobStatus.STARTING.value))
        return {int(row["id"]) for row in rows}

    def last_event(self) -> int:
        """The id of the newest event (0: none): events are numbered in the order their writes committed."""
        return int(self._tuples("SELECT COALESCE(MAX(id), 0) FROM events")[0][0])

    def moved_since(self, event_id: int) -> tuple[dict[int, JobStatus], int]:
        """The jobs moved by the events after ``event_id`` (a submission is a move), or changed while they
        waited (:data:`WAITING_CHANGES`: counted as a move into the queue), each with the state its last move
        put it in, and the newest event's id: a scan of those events only."""
        moved: dict[int, JobStatus] = {}
        last = event_id
        for last, job_id, state, moves in self._tuples(f"SELECT id, job_id, to_state, {CHANGES} FROM events WHERE "
                                                       "id > ? ORDER BY id", (event_id,)):
            if moves:
                moved[job_id] = JobStatus(state)
        return moved, last

    def waiting_rows(self, job_ids: Sequence[int] | None = None) -> list[WaitingRow]:
        """The waiting jobs (of ``job_ids``; None: all), as :data:`WAITING` reads them, by id: plain tuples."""
        if job_ids is None:
            return self._tuples(f"SELECT {WAITING} FROM jobs INDEXED BY jobs_state WHERE state = ? ORDER BY id",
                                (JobStatus.PENDING.value,))
        found: list[WaitingRow] = []
        for first in range(0, len(job_ids), 500):
            chunk = tuple(job_ids[first:first + 500])
            found += self._tuples(f"SELECT {WAITING} FROM jobs WHERE id IN ({','.join('?' * len(chunk))}) AND "
                                  "state = ? ORDER BY id", (*chunk, JobStatus.PENDING.value))
        return found

    def unsettled(self) -> list[Job]:
        """Cancelled jobs not yet known to have no process left (:meth:`settle`), from a partial index."""
        return [_job(row) for row in self._read("SELECT * FROM jobs INDEXED BY jobs_unsettled WHERE state = "
                                                "'CANCELLED' AND settled = 0 ORDER BY id")]

    def settle(self, job_id: int) -> None:
        """Record that a cancelled job has no process left: later ticks no longer look at it."""
        with self._write() as db:
            db.execute("UPDATE jobs SET settled = 1 WHERE id = ? AND state = ?", (job_id, JobStatus.CANCELLED.value))

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

    # -- elastic jobs ------------------------------------------------------------------------------
    def begin_resize(self, job: Job, gpus: int, batch: int, reason: str) -> WidthChange | None:
        """Record that running ``job`` is to move to ``gpus`` GPUs at global ``batch`` (phase STOPPING); None
        when it is not running or a resize of it is under way already (one at a time)."""
        with self._write() as db:
            if db.execute("SELECT 1 FROM jobs WHERE id = ? AND state = ?", (job.id, JobStatus.RUNNING.value)
                          ).fetchone() is None or db.execute(
                    "SELECT 1 FROM resizes WHERE job_id = ? AND phase IN ('STOPPING', 'RESTARTING')", (job.id,)
            ).fetchone() is not None:
                return None
            cursor = db.execute("INSERT INTO resizes(job_id, from_gpus, to_gpus, from_batch, to_batch, from_steps, "
                                "from_gain, phase, reason, asked_at) VALUES (?, ?, ?, ?, ?, ?, ?, 'STOPPING', ?, ?)",
                                (job.id, job.held, gpus, job.current_batch, batch, job.run_steps or job.steps,
                                 job.run_gain or 1.0, reason, datetime.now(UTC).timestamp()))
            row = db.execute("SELECT * FROM resizes WHERE id = ?", (cursor.lastrowid,)).fetchone()
        return _width_change(row)

    def update_resize(self, resize_id: int, phase: str, **measured: float | bool | None) -> None:
        """Move a resize to ``phase``, recording what it measured (:data:`RESIZE_FIELDS`)."""
        assert set(measured) <= set(RESIZE_FIELDS), measured
        sets = "".join(f", {name} = ?" for name in measured)
        with self._write() as db:
            db.execute(f"UPDATE resizes SET phase = ?{sets} WHERE id = ?", (phase, *measured.values(), resize_id))

    def open_resizes(self) -> list[WidthChange]:
        """The resizes under way (STOPPING or RESTARTING), from a partial index."""
        return [_width_change(row) for row in self._read(
            "SELECT * FROM resizes INDEXED BY resizes_open WHERE phase IN ('STOPPING', 'RESTARTING') ORDER BY id")]

    def resizing(self, job_id: int) -> bool:
        """Whether a resize of the job is under way."""
        return bool(self._read("SELECT 1 FROM resizes INDEXED BY resizes_job WHERE job_id = ? AND phase IN "
                               "('STOPPING', 'RESTARTING')", (job_id,)))

    def resizes(self, job_id: int | None = None) -> list[WidthChange]:
        """A job's resizes (every job's when None), oldest first."""
        where, args = ("WHERE job_id = ?", (job_id,)) if job_id is not None else ("", ())
        return [_width_change(row) for row in self._read(f"SELECT * FROM resizes {where} ORDER BY id", args)]

    def resizes_of(self, job_ids: Sequence[int]) -> list[WidthChange]:
        """The resizes of these jobs, oldest first (from an index)."""
        found: list[WidthChange] = []
        for first in range(0, len(job_ids), 500):
            chunk = tuple(job_ids[first:first + 500])
            found += [_width_change(row) for row in self._read(
                f"SELECT * FROM resizes INDEXED BY resizes_job WHERE job_id IN ({','.join('?' * len(chunk))}) "
                "ORDER BY id", chunk)]
        return sorted(found, key=lambda change: change.id)

    def resize_counts(self) -> tuple[dict[str, int], WidthChange | None]:
        """Resizes by phase, and the last one that finished (DONE)."""
        counts = {str(row["phase"]): int(row["n"])
                  for row in self._read("SELECT phase, COUNT(*) AS n FROM resizes GROUP BY phase")}
        last = self._read("SELECT * FROM resizes WHERE phase = 'DONE' AND restart_s IS NOT NULL ORDER BY id DESC "
                          "LIMIT 1")
        return counts, (_width_change(last[0]) if last else None)

    def set_shape(self, job_id: int, *, width: int, batch: int, steps: int, gain: float | None) -> None:
        """What the job's next attempt runs on: its GPUs, global batch, steps and AdaScale gain."""
        with self._write() as db:
            db.execute("UPDATE jobs SET width = ?, run_batch = ?, run_steps = ?, run_gain = ? WHERE id = ?",
                       (width, batch, steps, gain, job_id))

    def record_speed(self, point: SpeedPoint) -> None:
        with self._write() as db:
            db.execute("INSERT INTO speeds(job_id, gpus, batch, iteration_s, steps, gns) VALUES (?, ?, ?, ?, ?, ?) "
                       "ON CONFLICT(job_id, gpus, batch) DO UPDATE SET iteration_s = excluded.iteration_s, "
                       "steps = excluded.steps, gns = excluded.gns",
                       (point.job_id, point.gpus, point.batch, point.iteration_s, point.steps, point.gns))

    def speeds(self, job_ids: Sequence[int]) -> dict[int, list[SpeedPoint]]:
        """Each job's measured speeds, by (GPUs, batch)."""
        found: dict[int, list[SpeedPoint]] = {job_id: [] for job_id in job_ids}
        for first in range(0, len(job_ids), 500):
            chunk = tuple(job_ids[first:first + 500])
            for row in self._read(f"SELECT * FROM speeds WHERE job_id IN ({','.join('?' * len(chunk))}) "
                                  "ORDER BY gpus, batch", chunk):
                found[row["job_id"]].append(SpeedPoint(**dict(row)))
        return found

    def attempts(self, job_id: int) -> int:
        """How many times the job has been started (its moves into STARTING): the current attempt's number."""
        rows = self._read(f"SELECT COUNT(*) FROM events INDEXED BY events_moves WHERE job_id = ? AND to_state = ? "
                          f"AND {MOVES}", (job_id, JobStatus.STARTING.value))
        return int(rows[0][0])

    def integrity(self) -> str:
        return str(self._read("PRAGMA integrity_check")[0][0])


def _statements(script: str) -> Iterator[str]:
    """The statements of ``script`` one by one (``executescript`` would commit the transaction they run in)."""
    pending = ""
    for line in script.splitlines(keepends=True):
        pending += line
        if sqlite3.complete_statement(pending):
            yield pending.strip()
            pending = ""


def _locked(lock: Path, flag: str, busy: str) -> IO[str]:
    """``lock`` opened and held with an exclusive ``flock``; a holder already there is refused in one line
    naming ``flag`` and what it wrote (``busy``: how to fix it)."""
    try:
        handle = lock.open("a+")
    except OSError as err:
        raise DeeppoolError(f"{flag}: cannot open '{lock}' ({err.strerror})") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise DeeppoolError(f"{flag} is in use by another server ({holder}): {busy}") from None
    handle.seek(0)
    return handle


def _stamp(handle: IO[str], text: str) -> IO[str]:
    handle.seek(0)
    handle.truncate()
    handle.write(text + "\n")
    handle.flush()
    return handle


def lock_database(path: Path) -> IO[str]:
    """Hold ``path``'s server lock (an exclusive ``flock`` on ``PATH.lock``) while the returned file is open."""
    real = path.resolve()  # one lock however the database is named (a link to it too)
    handle = _locked(real.with_name(real.name + ".lock"), f"--db '{path}'", "stop it, or give another --db")
    return _stamp(handle, f"pid {os.getpid()}")


def default_log_dir(db: Path) -> Path:
    """Where a server on ``db`` keeps its jobs' files unless told (``--log-dir``): ``logs/NAME`` beside it, so
    two databases in one folder never share one."""
    db = db.resolve()
    return db.parent / "logs" / db.name


STATE_FILE = "state.lock"
"""In a log folder: the database whose jobs it holds, locked by the server serving it."""


def claim_log_dir(folder: Path, identity: str) -> IO[str]:
    """Hold ``folder`` for the database ``identity`` while the returned file is open: a folder holding another
    database's jobs, or in use by another server, is refused (its files, cgroups and jobs are that state's)."""
    handle = _locked(folder / STATE_FILE, f"--log-dir '{folder}'", "give each database its own --log-dir")
    owner = handle.read().split(",")[0].strip()
    if owner not in ("", f"database {identity}"):
        handle.close()
        raise DeeppoolError(f"--log-dir '{folder}' holds the jobs of another database ({owner}): give each "
                            "database its own --log-dir")
    return _stamp(handle, f"database {identity}, pid {os.getpid()}")


def _event(row: sqlite3.Row) -> JobEvent:
    return JobEvent(id=row["id"], job_id=row["job_id"], to_state=JobStatus(row["to_state"]), reason=row["reason"],
                    at=datetime.fromisoformat(row["at"]),
                    from_state=JobStatus(row["from_state"]) if row["from_state"] else None)


def _width_change(row: sqlite3.Row) -> WidthChange:
    data = dict(row)
    data["plan_cached"] = None if data["plan_cached"] is None else bool(data["plan_cached"])
    return WidthChange(**data)


def _job(row: sqlite3.Row) -> Job:
    shape = row["input_shape"]
    return Job(id=row["id"], kind=JobKind(row["kind"]), state=JobStatus(row["state"]), owner=row["owner"],
               model=row["model"], gpus=row["gpus"], batch=row["batch"], steps=row["steps"],
               amplification=row["amplification"], input_shape=tuple(json.loads(shape)) if shape else None,
               input_dtype=row["input_dtype"], vocab_size=row["vocab_size"],
               created_at=datetime.fromisoformat(row["created_at"]),
               updated_at=datetime.fromisoformat(row["updated_at"]), reason=row["reason"],
               exit_code=row["exit_code"], progress=row["progress"], host_id=row["host_id"], script=row["script"],
               width=row["width"], run_batch=row["run_batch"], run_steps=row["run_steps"], run_gain=row["run_gain"])

