"""Finished jobs' files leave the jobs' folder: after a time, and oldest first while its disk is short.

A job's files in the server's jobs folder are its log ``job-N.log``, its attempts' files ``job-N.A.*`` and its
working folder ``job-N/`` (model copy, plan, checkpoints, summary). They are removed only once the job has
ended and no process of it is left (a cancelled job once it is settled), in two cases:

* its end is older than :attr:`Retention.keep_s` (``serve --keep-job-files-days``; ``None``: kept);
* the jobs' file system has less than :attr:`Retention.min_free_bytes` free (``serve --min-free-mb``): the
  files of the jobs that ended first go first, until there is room again or no ended job's files are left.

Each removal is an event of its job ("its files were removed: ..."), so a log that is gone says why
(:func:`removed_reason`). The sweep reads the folder's listing (the jobs whose files are still there, not the
whole history) and runs in its own thread every :attr:`Retention.period_s`; a sweep that fails is logged and
retried, never raised. Files the server cannot remove (a working folder a job's account made unwritable) are
left, and said once in the server's log.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from deeppool.coordinator.jobs import Job, JobStatus
from deeppool.coordinator.store import Store

REMOVED = "its files were removed: "
"""How a removal's event begins (its reason follows)."""
_NAME = re.compile(r"job-(\d+)(?:\.log|\.\d+\..+|)$")
log = logging.getLogger("deeppool.coordinator")


@dataclass(frozen=True, kw_only=True)
class Retention:
    keep_s: float | None
    """Seconds a finished job's files are kept after its end; None: until the disk is short."""
    min_free_bytes: int
    """Free space the jobs' file system keeps: below it, ended jobs' files are removed, those that ended first."""
    period_s: float = 60.0


@dataclass(frozen=True, kw_only=True)
class Sweep:
    removed: tuple[int, ...]
    """Jobs whose files this sweep removed, in the order it removed them."""
    free_bytes: int | None
    """Free space in the jobs' folder after the sweep (None: unknown)."""


def free_bytes(folder: Path) -> int | None:
    try:
        info = os.statvfs(folder)
    except OSError:
        return None
    return info.f_bavail * info.f_frsize


def disk_short(folder: Path, retention: Retention) -> str | None:
    """None while the jobs' folder has its free space; else a one-line reason."""
    free = free_bytes(folder)
    if free is None or free >= retention.min_free_bytes:
        return None
    return (f"the jobs' disk is short ({free >> 20} MiB free in {folder}, serve --min-free-mb "
            f"{retention.min_free_bytes >> 20}): ended jobs' files are removed first; running jobs may fail")


def files_by_job(folder: Path) -> dict[int, list[Path]]:
    """The entries of ``folder`` that belong to a job, by job id."""
    found: dict[int, list[Path]] = {}
    with os.scandir(folder) as entries:
        for entry in entries:
            match = _NAME.match(entry.name)
            if match:
                found.setdefault(int(match.group(1)), []).append(Path(entry.path))
    return found


def _ended(store: Store, job_id: int) -> Job | None:
    """The job if it has ended with no process of it left, else None."""
    job = store.job(job_id)
    if job is None or not job.state.terminal:
        return None
    if job.state is JobStatus.CANCELLED and any(j.id == job_id for j in store.unsettled()):
        return None
    return job


def _remove(paths: list[Path]) -> list[str]:
    """Remove every path; what could not be removed, one line each."""
    left: list[str] = []

    def _failed(function: Callable[..., object], path: str, info: tuple[type, BaseException, object]) -> None:
        del function
        left.append(f"{path}: {info[1]}")

    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, onerror=_failed)
        else:
            try:
                path.unlink(missing_ok=True)
            except OSError as err:
                left.append(f"{path}: {err}")
    return left


def sweep(store: Store, folder: Path, retention: Retention, now: datetime | None = None) -> Sweep:
    """Remove the files of ended jobs that are past their time, then, while the disk is short, of the others
    that ended first. Each removal is recorded as an event of its job."""
    now = now or datetime.now(UTC)
    if retention.keep_s is None and disk_short(folder, retention) is None:
        return Sweep(removed=(), free_bytes=free_bytes(folder))  # nothing can be due: the folder is not read
    ended = sorted((job for job in (_ended(store, i) for i in files_by_job(folder)) if job is not None),
                   key=lambda job: (job.updated_at, job.id))
    removed: list[int] = []
    for job in ended:
        age_s = (now - job.updated_at).total_seconds()
        if retention.keep_s is not None and age_s > retention.keep_s:
            reason = f"{age_s / 86400:.1f} days after the job ended (serve --keep-job-files-days)"
        elif disk_short(folder, retention) is not None:
            reason = "the jobs' disk was short, and this job had ended before the others (serve --min-free-mb)"
        else:
            continue
        left = _remove(files_by_job(folder).get(job.id, []))
        for line in left[:1]:
            log.warning("could not remove job %d's files (%d left): %s", job.id, len(left), line)
        store.note(job.id, [reason], prefix=REMOVED)
        removed.append(job.id)
    return Sweep(removed=tuple(removed), free_bytes=free_bytes(folder))


def removed_reason(store: Store, job_id: int) -> str | None:
    """Why a job's files are gone (its removal event's reason), or None if they were never removed."""
    for event in store.events(job_id):
        if event.reason.startswith(REMOVED):
            return event.reason
    return None


class Sweeper:
    """Runs :func:`sweep` every ``retention.period_s`` in a thread of its own, until :meth:`stop`."""

    def __init__(self, store: Store, folder: Path, retention: Retention) -> None:
        self.store, self.folder, self.retention = store, folder, retention
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="deeppool-retention", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(10)

    def _loop(self) -> None:
        while not self._stop.wait(self.retention.period_s):
            try:
                sweep(self.store, self.folder, self.retention)
            except Exception:  # noqa: BLE001: a failed sweep must leave the server serving, and say so
                log.exception("removing ended jobs' files failed; retrying in %.0f s", self.retention.period_s)
