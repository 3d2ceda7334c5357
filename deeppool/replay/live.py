"""The live half of a replay: submit a slice to a running coordinator on its schedule and record what it did.

Each job is submitted at its arrival, as a foreground job or, where the slice says so, a background job
(an idempotency key per replay and job, so a retried request never makes a second job). The client polls
the job list every ``poll_s`` seconds and keeps, per job, when it was submitted (the server's
``created_at``), when it held slots (from a state change's ``updated_at``: STARTING or RUNNING opens an
interval, PENDING or an end closes it), on how many slots (a resize under a co-adaptive policy changes
them: a new width is timed by the ``updated_at`` of the move that came with it, else by the poll that saw
it), on whose ranks (a background job lent a running job's idle ranks: its ``host_id``), its progress at
each interval's start and end, and how it ended. A job first seen already past a state is timed by the poll
that saw it last in the state before, so a time is late by at most ``poll_s``. Once every job has ended,
each succeeded job's log gives its measured iteration time (the run's ``iteration: measured X ms`` line, the
slowest rank's median after warm-up), and the coordinator's ``GET /v1/jobs/{id}/speed`` its speed points and
resizes. Times are seconds from the first submission.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from deeppool.cluster_sim.workload import TraceJob
from deeppool.coordinator.client import Client
from deeppool.coordinator.jobs import Job, JobKind, JobRequest, JobSpeed, JobStatus
from deeppool.errors import DeeppoolError
from deeppool.replay.slicing import ReplayJob, StepTimer
from deeppool.scheduling.choice import ModelChoice

ITERATION = re.compile(r"^iteration: measured (?P<ms>[\d.]+) ms", re.MULTILINE)
HOLDING = (JobStatus.STARTING, JobStatus.RUNNING)


@dataclass(frozen=True, kw_only=True)
class LiveRecord:
    """One job of the live run: its coordinator id, times (seconds from the first submission) and result."""

    job: ReplayJob
    job_id: int
    submitted_s: float
    held: tuple[tuple[float, float], ...]
    """the intervals it held its slots: (from, to)"""
    state: JobStatus
    reason: str
    iteration_s: float | None
    """its run's measured iteration time; None when it did not succeed or its log does not say"""
    widths: tuple[tuple[float, float, int], ...] = ()
    """the held intervals cut where its width changed: (from, to, slots)"""
    speed: JobSpeed | None = None
    """what the coordinator measured of it: speed points and resizes"""
    hosts: tuple[int | None, ...] = ()
    """per held interval, the foreground job (its coordinator id) whose idle ranks it was lent; None: whole slots"""
    gained: tuple[float, ...] = ()
    """per held interval, the share of its steps it made there (its progress at the poll that saw the interval
    end, less that at the poll that saw it begin)"""

    def lent_steps(self) -> float:
        """The steps it made on lent ranks."""
        return sum(share * self.job.steps for share, host in zip(self.gained, self.hosts, strict=False)
                   if host is not None)

    @property
    def lent_s(self) -> float:
        """The time it ran on lent ranks of a running foreground job."""
        return sum(end - start for (start, end), host in zip(self.held, self.hosts, strict=False) if host is not None)

    @property
    def finished_s(self) -> float:
        return self.held[-1][1] if self.held else self.submitted_s

    @property
    def started_s(self) -> float:
        return self.held[0][0] if self.held else self.finished_s

    @property
    def jct_s(self) -> float:
        return self.finished_s - self.submitted_s


@dataclass(frozen=True, kw_only=True)
class LiveRun:
    url: str
    slots: int
    records: tuple[LiveRecord, ...]
    began_at: float = 0.0
    """the first submission's wall time (Unix seconds): a policy that decides on a wall-clock tick ticks at
    the same offsets from it in the simulation"""

    @property
    def makespan_s(self) -> float:
        return max(record.finished_s for record in self.records)

    def failed(self) -> list[LiveRecord]:
        """Jobs that did not succeed, or whose log gave no iteration time (a job lent a host's ranks may have none:
        its speed is its lent time)."""
        return [r for r in self.records if r.state is not JobStatus.SUCCEEDED
                or (r.iteration_s is None and not any(host is not None for host in r.hosts))]


@dataclass(kw_only=True)
class _Watch:
    """What the polls saw of one job (mutable, private to :func:`run_live`)."""

    job: ReplayJob
    job_id: int
    created: datetime
    state: JobStatus = JobStatus.PENDING
    last_seen: datetime | None = None
    opened: datetime | None = None
    held: list[tuple[datetime, datetime]] = field(default_factory=list)
    widths: list[tuple[datetime, int]] = field(default_factory=list)
    """(from when, slots) each time the width it held changed"""
    reason: str = ""
    host: int | None = None
    """the foreground job whose ranks the open interval runs on (a lent background job)"""
    hosts: list[int | None] = field(default_factory=list)
    progress: float = 0.0
    """its progress when the open interval began"""
    gained: list[float] = field(default_factory=list)

    def see(self, job: Job, polled: datetime) -> None:
        """Record a poll's view of the job; a state change is timed by its ``updated_at``, a width change by
        the ``updated_at`` of a move that came with it, else by the poll."""
        if job.state in HOLDING and (not self.widths or self.widths[-1][1] != job.held):
            moved = job.state is not self.state or (self.last_seen is not None and job.updated_at > self.last_seen)
            self.widths.append((job.updated_at if moved else polled, job.held))
        if job.state in HOLDING and job.host_id is not None:
            self.host = job.host_id
        if job.state is not self.state:
            holding = job.state in HOLDING
            if holding and self.opened is None:
                self.opened, self.progress = job.updated_at, job.progress
            elif not holding and self.opened is not None:
                self.held.append((self.opened, job.updated_at))
                self.hosts.append(self.host)
                self.gained.append(max(0.0, _done(job) - self.progress))
                self.opened, self.host = None, None
            elif job.state.terminal and self.state is JobStatus.PENDING:  # it ran between two polls
                self.held.append((self.last_seen or self.created, job.updated_at))
                self.hosts.append(job.host_id)
                self.gained.append(max(0.0, _done(job) - self.progress))
                self.widths.append((self.last_seen or self.created, job.held))
            self.state, self.reason = job.state, job.reason or ""
        self.last_seen = polled


def run_live(jobs: Sequence[ReplayJob], client: Client, *, poll_s: float = 0.25, timeout_s: float = 3600.0,
             say: Callable[[str], None] = lambda line: None) -> LiveRun:
    """Submit ``jobs`` at their arrivals, wait until all have ended (at most ``timeout_s``: then the rest are
    cancelled and the replay fails), and return what happened."""
    slots = int(client.cluster()["gpus"])
    if max(job.gpus for job in jobs) > slots:
        raise DeeppoolError(f"the slice was scaled for more slots than the coordinator at {client.url} has ({slots})")
    tag = uuid.uuid4().hex[:8]
    pending = sorted(jobs, key=lambda job: job.arrival_s)
    watches: dict[int, _Watch] = {}
    began = time.monotonic()
    while pending or any(not w.state.terminal for w in watches.values()):
        elapsed = time.monotonic() - began
        while pending and pending[0].arrival_s <= elapsed:
            job = pending.pop(0)
            made = client.submit(_request(job, tag))
            watches[made.id] = _Watch(job=job, job_id=made.id, created=made.created_at)
            say(f"{elapsed:7.1f} s  submitted {job.name} as job {made.id} ({job.gpus} slots, {job.steps} steps)")
        polled = datetime.now(UTC)
        for found in client.jobs() if watches else ():
            if found.id in watches:
                watch = watches[found.id]
                before = watch.state
                watch.see(found, polled)
                if watch.state is not before and watch.state.terminal:
                    say(f"{elapsed:7.1f} s  {watch.job.name} (job {found.id}) {watch.state.value}")
        if elapsed > timeout_s:
            _abandon(client, watches.values())
            raise DeeppoolError(f"the replay did not finish in {timeout_s:.0f} s: its jobs were cancelled")
        time.sleep(poll_s)
    return _collect(client, watches)


def calibrate(client: Client, needs: Sequence[tuple[ModelChoice, int]], *, steps: int = 20,
              timeout_s: float = 1800.0, say: Callable[[str], None] = lambda line: None) -> StepTimer:
    """Each (model, slots)'s iteration time on the coordinator itself: one job of ``steps`` steps each, all
    submitted at once; a step timer that answers for those (model, slots), from their logs."""
    jobs = [ReplayJob(name=f"calibrate-{model.name}-{model.global_batch}-{gpus}", arrival_s=0.0, gpus=gpus,
                      model=model, steps=steps, run_s=0.0,
                      trace=TraceJob(name=model.name, arrival_s=0.0, gpus=gpus, duration_s=1.0, key=model.name))
            for model, gpus in needs]
    run = run_live(jobs, client, timeout_s=timeout_s, say=say)
    failed = run.failed()
    if failed:
        raise DeeppoolError(f"calibrating {failed[0].job.name} (job {failed[0].job_id}) did not measure an "
                            f"iteration time: {failed[0].state.value}, {failed[0].reason}")
    measured = {(str(r.job.model.path), r.job.batch, r.job.gpus): r.iteration_s or 0.0 for r in run.records}
    return lambda model, gpus: measured[(str(model.path), model.global_batch, gpus)]


def _request(job: ReplayJob, tag: str) -> JobRequest:
    kind = JobKind.BACKGROUND if job.background else JobKind.FOREGROUND
    return JobRequest(kind=kind, model=str(job.model.path), gpus=job.gpus, batch=job.batch,
                      steps=job.steps, idempotency_key=f"replay-{tag}-{job.name}")


def _abandon(client: Client, watches: Iterable[_Watch]) -> None:
    for watch in watches:
        if not watch.state.terminal:
            try:
                client.cancel(watch.job_id)
            except DeeppoolError:
                continue


def _collect(client: Client, watches: dict[int, _Watch]) -> LiveRun:
    zero = min(w.created for w in watches.values())

    def since(at: datetime) -> float:
        return (at - zero).total_seconds()

    records = []
    for job_id, watch in sorted(watches.items()):
        iteration = measured_iteration_s("".join(client.log(job_id))) if watch.state is JobStatus.SUCCEEDED else None
        held = tuple((since(a), since(b)) for a, b in watch.held)
        records.append(LiveRecord(job=watch.job, job_id=job_id, submitted_s=since(watch.created), held=held,
                                  state=watch.state, reason=watch.reason, iteration_s=iteration,
                                  widths=cut_by_width(held, [(since(at), slots) for at, slots in watch.widths],
                                                      watch.job.gpus),
                                  speed=client.speed(job_id), hosts=tuple(watch.hosts), gained=tuple(watch.gained)))
    return LiveRun(url=client.url, slots=int(client.cluster()["gpus"]), records=tuple(records),
                   began_at=zero.timestamp())


def _done(job: Job) -> float:
    """Its progress: all of its steps once it succeeded."""
    return 1.0 if job.state is JobStatus.SUCCEEDED else job.progress


def cut_by_width(held: Sequence[tuple[float, float]], changes: Sequence[tuple[float, int]],
                 asked: int) -> tuple[tuple[float, float, int], ...]:
    """The held intervals cut where the width changed (``changes``: (from when, slots), in order): (from, to,
    slots); before the first change a job holds the slots it ``asked`` for."""
    cut = []
    for start, end in held:
        width = next((slots for at, slots in reversed(changes) if at <= start), changes[0][1] if changes else asked)
        edges = [(at, slots) for at, slots in changes if start < at < end]
        for at, slots in edges:
            if slots != width:
                cut.append((start, at, width))
                start, width = at, slots
        cut.append((start, end, width))
    return tuple(cut)


def measured_iteration_s(log: str) -> float | None:
    """The run's measured iteration time in seconds, from its log's ``iteration: measured X ms`` line."""
    found = ITERATION.findall(log)
    return float(found[-1]) / 1e3 if found else None
