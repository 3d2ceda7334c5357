"""The waiting jobs as the scheduler reads them every tick: each read once, then kept while it waits.

Every move of a job (its submission, a start, a requeue, a cancel) is a row of
the append-only event log, written in the move's own transaction, and events
are numbered in the order their writes commit. The first read takes every
waiting job (:meth:`Store.waiting_rows
<deeppool.coordinator.store.Store.waiting_rows>`: a few columns as plain
tuples) and turns each into the policy's :class:`~deeppool.scheduling.SimJob`
once; each later read takes only the events since the last one
(:meth:`Store.moved_since <deeppool.coordinator.store.Store.moved_since>`),
reads again the jobs they moved into the queue and drops those they moved
out. A tick's cost per waiting job is so a list entry, not a database row
and a validated :class:`~deeppool.coordinator.jobs.Job` (which the service
builds only for the jobs a decision names).

What is kept of a waiting job is written once, at its submission, except the
shape an elastic resize gives it (``width``, ``run_batch``): that change, and
one of its progress or measured speeds while it waits, is an event the
database writes in the change's own transaction
(:data:`~deeppool.coordinator.store.WAITING_CHANGES`), which
:meth:`~deeppool.coordinator.store.Store.moved_since` counts as a move into
the queue, so the job is read again. An elastic policy's speed models of the
waiting jobs are kept the same way (:mod:`deeppool.coordinator.waiting_models`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol

from deeppool.coordinator.jobs import Job, JobKind, JobStatus
from deeppool.coordinator.store import Store, WaitingRow
from deeppool.scheduling import ModelChoice, SimJob, SpeedModel

BACKGROUND = JobKind.BACKGROUND.value


@functools.lru_cache(maxsize=4096)
def model_choice(model: str, batch: int) -> ModelChoice:
    """The policy's view of a job's model (a pure function of the two, kept for the many jobs that share them)."""
    path = Path(model) if model.endswith(".py") else Path(model.replace(".", "/").split(":")[0])
    return ModelChoice(name=path.stem, path=path, global_batch=batch)


@dataclass(frozen=True, slots=True, kw_only=True)
class Waiting:
    """A waiting job: what choosing a guest needs of it (kind, owner), whether it ran before (``requeued``:
    preempted, or its host ended), and the policy's view of it (``sim``, without a speed model)."""

    id: int
    kind: JobKind
    owner: str
    requeued: bool
    sim: SimJob

    @classmethod
    def of(cls, row: WaitingRow, speed: SpeedModel | None = None) -> Waiting:
        """From the columns :meth:`Store.waiting_rows` reads (``speed``: its model, under an elastic policy)."""
        job_id, kind, owner, model, gpus, width, batch, run_batch, steps, created_at, requeued = row
        background = kind == BACKGROUND
        sim = SimJob(job_id=job_id, name=f"job-{job_id}", arrival_s=datetime.fromisoformat(created_at).timestamp(),
                     gpus=width or gpus, background=background, iterations=float(steps), recorded_duration_s=0.0,
                     model=model_choice(model, run_batch or batch), speed=speed)
        return cls(id=job_id, kind=JobKind.BACKGROUND if background else JobKind.FOREGROUND, owner=owner,
                   requeued=bool(requeued), sim=sim)

    @classmethod
    def of_job(cls, job: Job, requeued: bool) -> Waiting:
        """From a job's full row."""
        sim = SimJob(job_id=job.id, name=f"job-{job.id}", arrival_s=job.created_at.timestamp(), gpus=job.held,
                     background=job.kind is JobKind.BACKGROUND, iterations=float(job.steps), recorded_duration_s=0.0,
                     model=model_choice(job.model, job.current_batch))
        return cls(id=job.id, kind=job.kind, owner=job.owner, requeued=requeued, sim=sim)


@dataclass(frozen=True, kw_only=True)
class Queue:
    """The waiting jobs by id, and the policy's lists of them (:class:`~deeppool.scheduling.Snapshot`'s
    ``waiting``, ``waiting_fg``, ``waiting_bg`` and ``requeued``), made once for each state of the queue: a
    tick hands the policy copies of them."""

    jobs: dict[int, Waiting]
    sims: list[SimJob]
    foreground: list[SimJob]
    background: list[SimJob]
    requeued: list[SimJob]
    """the jobs started before, by arrival"""

    @classmethod
    def of(cls, jobs: dict[int, Waiting]) -> Queue:
        sims = [w.sim for w in jobs.values()]
        return cls(jobs=jobs, sims=sims, foreground=[j for j in sims if not j.background],
                   background=[j for j in sims if j.background],
                   requeued=sorted((w.sim for w in jobs.values() if w.requeued),
                                   key=lambda j: (j.arrival_s, j.job_id)))


class SpeedModels(Protocol):
    """The waiting jobs' speed models, made when the queue reads them and kept while they wait (an elastic
    policy's: :class:`~deeppool.coordinator.waiting_models.WaitingModels`)."""

    def made(self, rows: Sequence[WaitingRow]) -> Mapping[int, SpeedModel]:
        """The models of the jobs just read (by id), kept with what else they need."""
        ...

    def forget(self, job_ids: Iterable[int]) -> None:
        """The jobs moved, or changed while they waited: what was kept of them goes."""
        ...


class WaitingJobs:
    """The waiting jobs of one store, kept between ticks (one instance per service); ``models``: their speed
    models, made with them (None: none)."""

    def __init__(self, store: Store, models: SpeedModels | None = None) -> None:
        self.store, self.models = store, models
        self._seen: int | None = None  # the last event read (None: nothing read yet)
        self._queue = Queue.of({})

    def read(self) -> Queue:
        """The waiting jobs now (by id), the same object as the last read while nothing moved."""
        if self._seen is None:
            self._seen = self.store.last_event()  # first: what comes after is read again next time
            self._queue = Queue.of(self._made(self.store.waiting_rows()))
            return self._queue
        moved, self._seen = self.store.moved_since(self._seen)
        if not moved:
            return self._queue
        known = dict(self._queue.jobs)
        last = next(reversed(known), 0)
        for job_id in moved:
            known.pop(job_id, None)
        if self.models is not None:
            self.models.forget(moved)
        back = self._made(self.store.waiting_rows(sorted(
            job_id for job_id, state in moved.items() if state is JobStatus.PENDING)))
        known.update(back)
        if back and next(iter(back)) < last:  # one that waited before (a requeue) goes back in its place
            known = dict(sorted(known.items()))
        self._queue = Queue.of(known)
        return self._queue

    def _made(self, rows: Sequence[WaitingRow]) -> dict[int, Waiting]:
        speeds = self.models.made(rows) if self.models is not None else {}
        return {row[0]: Waiting.of(row, speeds.get(row[0])) for row in rows}
