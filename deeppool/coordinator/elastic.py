"""Elastic jobs: a running foreground job moved to another GPU count (and batch) from a checkpoint.

A resize goes through phases, each committed to the database (``resizes``)
before the step it names is taken, so a server killed at any point carries it
on when it starts again:

1. **STOPPING.** The server writes the job's stop file
   (:func:`~deeppool.coordinator.driver.stop_file`, as the job's account,
   beside its folder). Every rank looks for it after each step and the ranks
   agree by one all-reduce, so all stop after the same step: the run writes a
   checkpoint and ``run/stopped.json`` (after which step, when) and ends.
2. **RESTARTING.** The attempt ended after its stop: the job's shape (GPUs,
   batch, steps, AdaScale gain) becomes the new one, its guests are requeued,
   the stop file is removed, and the job goes RUNNING → STARTING. Its next
   attempt plans for the new GPU count with the same planner (a plan cached
   in the job's folder when it had this (GPUs, batch) before) and resumes from
   the checkpoint.
3. **DONE** when the new attempt took its first step (its ``progress.json``
   says when); the costs are recorded: ``checkpoint_s`` (the ask to the
   checkpoint written, the step boundary included), ``stop_s`` (to the old
   attempt's end, as the server saw it), ``plan_s`` (the driver's planning,
   or reading the cached plan) and ``restart_s`` (the new attempt's launch to
   its first step, less ``plan_s``). **REVERTED** when the new attempt failed
   before its first step: the job goes back to its last good shape, from the
   same checkpoint (no step lost), the reason in its events. **MOOT** when
   the job ended before it saw the stop file (it finished, failed or was
   cancelled) or was moved otherwise.

A resize to 0 GPUs is a resumable preemption: the job stops at a step
boundary with a checkpoint and goes back to the queue; its next start resumes.

At a fixed batch the run continues exactly (the checkpoint holds the weights,
the optimizer's state and the data position). When the policy changes the
batch from ``M`` to ``M'``, progress is counted in steps at the asked batch
``M₀``: one step at ``M'`` is worth AdaScale's gain ``r(M')`` of them
(:func:`~deeppool.adaptation.goodput.adascale_gain`, for the job's measured
noise scale), the learning rate is the base one times ``r(M')``, and the
steps left are converted: ``(N − k) · r(M) / r(M')`` steps at ``M'`` for the
``N − k`` left at ``M``.

A job that cannot checkpoint, a script job (its own loop never hands the
executor its ``state_dict()``), is never resized: :meth:`Elastic.resizable`,
and the policy sees it as rigid (:func:`~deeppool.coordinator.speeds.speed_model`).
"""

from __future__ import annotations

import enum
import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

from deeppool.adaptation.goodput import adascale_gain
from deeppool.coordinator.driver import ATTEMPT, stop_file
from deeppool.coordinator.isolation import write_private
from deeppool.coordinator.jobs import Job, JobKind, JobStatus, SpeedPoint, WidthChange
from deeppool.coordinator.launcher import LaunchPhase
from deeppool.coordinator.runtime import Runtime, count
from deeppool.coordinator.speeds import LiveSpeed, measured, speed_model, unmeasured
from deeppool.coordinator.store import WaitingRow
from deeppool.coordinator.waiting_models import Models, WaitingModels
from deeppool.errors import DeeppoolError
from deeppool.executor.training.outputs import PROGRESS, STEPS, STOPPED
from deeppool.scheduling import Adaptive, Decision

log = logging.getLogger("deeppool.coordinator")

SPEED_EVERY_S = 5.0
"""How often a running job's measured speed is read again."""


class ResizePhase(enum.Enum):
    STOPPING = "STOPPING"
    RESTARTING = "RESTARTING"
    DONE = "DONE"
    REVERTED = "REVERTED"
    MOOT = "MOOT"


@dataclass(frozen=True, kw_only=True)
class ElasticView:
    """What the policy's snapshot takes from the elastic jobs: each job's speed model (on whole GPUs), the state
    of those that have run, and the GPUs a job being resized holds (the more of its old and new count)."""

    speeds: Mapping[int, LiveSpeed] = field(default_factory=dict)
    adaptive: Mapping[int, Adaptive] = field(default_factory=dict)
    reserved: Mapping[int, int] = field(default_factory=dict)


class Elastic:
    def __init__(self, runtime: Runtime, total_gpus: int, *, clock: Callable[[], float] | None = None) -> None:
        """``clock``: wall time in Unix seconds (the runs' own timestamps are). :attr:`waiting` makes and keeps
        the waiting jobs' models as the service's waiting queue reads them (:meth:`view_of`)."""
        self.runtime, self.store, self.total_gpus = runtime, runtime.store, total_gpus
        self.clock = clock or (lambda: datetime.now(UTC).timestamp())
        self._read_at: dict[int, float] = {}
        self.waiting = WaitingModels(self.waiting_models)

    def resizable(self, job: Job) -> bool:
        """A foreground job with a model (a script job cannot checkpoint), of a server whose jobs run resizable
        (``DriverSteps.elastic``, and not ``check``: a checked run trains its reference from the start)."""
        return (job.kind is JobKind.FOREGROUND and job.script is None and job.host_id is None
                and self._runs_resizable())

    def _runs_resizable(self) -> bool:
        steps = self.runtime.steps
        return bool(getattr(steps, "elastic", False)) and not getattr(steps, "check", False)

    # -- asking ------------------------------------------------------------------------------------
    def resize(self, job: Job, gpus: int, batch: int, reason: str) -> bool:
        """Begin moving running ``job`` to ``gpus`` GPUs (0: a resumable preemption) at global ``batch``;
        False when it cannot be (not resizable, not running, a resize under way, a batch change with no noise
        scale measured, a shape whose restart failed before)."""
        if not self.resizable(job) or job.state is not JobStatus.RUNNING or gpus < 0 or batch < 1:
            return False
        if (gpus, batch) == (job.held, job.current_batch):
            return False
        if batch != job.current_batch and self._noise(job) is None:
            return False
        if any(c.phase == ResizePhase.REVERTED.value and (c.to_gpus, c.to_batch) == (gpus, batch)
               for c in self.store.resizes(job.id)):
            return False  # its restart failed on this shape once: not again
        change = self.store.begin_resize(job, gpus, batch, reason)
        if change is None:
            return False
        self.store.note(job.id, [_asked(change)], prefix=f"resize {change.id}: ")
        self._write_stop(job)
        return True

    def apply(self, decision: Decision, jobs: Mapping[int, Job], policy: str) -> set[int]:
        """The part of ``decision`` that resizes: a running job both preempted and started (to the start's GPUs
        and batch), a batch change, a preempted elastic job (stopped resumably); a waiting job started on another
        count takes it. The ids it handled (the service applies the rest)."""
        handled: set[int] = set()
        preempted = set(decision.preempt)
        for start in decision.start:
            job = jobs.get(start.job_id)
            if job is None:
                continue
            batch = start.batch or job.current_batch
            if job.state is JobStatus.RUNNING and start.job_id in preempted:
                self.resize(job, start.gpus, batch, f"the {policy} policy gives it {start.gpus} GPUs at batch {batch}")
                handled.add(job.id)
            elif job.state is JobStatus.PENDING and self.resizable(job) and start.gpus != job.held:
                self._reshape_waiting(job, start.gpus)
        for change in decision.rebatch:
            job = jobs.get(change.job_id)
            if job is not None:
                self.resize(job, job.held, change.batch, f"the {policy} policy sets its batch to {change.batch}")
                handled.add(job.id)
        for job_id in preempted - handled:
            job = jobs.get(job_id)
            if job is not None and job.state is JobStatus.RUNNING and self.resizable(job):
                self.resize(job, 0, job.current_batch, f"preempted by the {policy} policy: stopped resumably")
                handled.add(job_id)
        return handled

    def _reshape_waiting(self, job: Job, gpus: int) -> None:
        """A waiting job the policy starts on another GPU count: its next attempt plans for them (and resumes
        from its checkpoint, if it ran before)."""
        self.store.set_shape(job.id, width=gpus, batch=job.current_batch, steps=job.run_steps or job.steps,
                             gain=job.run_gain)

    # -- the policy's view -------------------------------------------------------------------------
    def view(self, jobs: Iterable[Job]) -> ElasticView:
        """Speed models of the jobs on whole GPUs (a background job's and a script job's rigid), the state of
        those that ran, the GPUs resizes hold: all from the jobs' rows as given (:meth:`view_of` gives the
        same, the waiting jobs' part kept between ticks)."""
        speeds, adaptive = self.models([j for j in jobs if j.host_id is None])
        return ElasticView(speeds=speeds, adaptive=adaptive, reserved=self._reserved())

    def view_of(self, live: Sequence[Job]) -> ElasticView:
        """:meth:`view` of the ``live`` jobs' rows and of the waiting jobs the service keeps: their speed models
        are in its queue and their adaptive states in :attr:`waiting` (both made when the queue reads a job);
        the live jobs' are made at every call. The view's ``speeds`` are the live jobs' only."""
        speeds, adaptive = self.models([j for j in live if j.host_id is None])
        return ElasticView(speeds=speeds, adaptive={**self.waiting.adaptive, **adaptive}, reserved=self._reserved())

    def models(self, jobs: Sequence[Job]) -> Models:
        """The speed models of ``jobs`` (on whole GPUs) from their measured speeds, and the state of those that
        are not waiting or were resized before."""
        ids = [j.id for j in jobs]
        points = self.store.speeds(ids)
        history: dict[int, list[WidthChange]] = {}
        for change in self.store.resizes_of(ids):
            history.setdefault(change.job_id, []).append(change)
        speeds = {j.id: speed_model(j, points[j.id], total_gpus=self.total_gpus, rigid=not self.resizable(j))
                  for j in jobs}
        adaptive = {j.id: Adaptive(progress=j.progress * j.steps,
                                   batch=j.current_batch if j.state is not JobStatus.PENDING else None,
                                   restarts=len(history.get(j.id, ())),
                                   peak_gpus=max([j.held, *(c.to_gpus for c in history.get(j.id, ()))]))
                    for j in jobs if j.state is not JobStatus.PENDING or j.id in history}
        return speeds, adaptive

    def waiting_models(self, rows: Sequence[WaitingRow]) -> Models:
        """:meth:`models` of waiting jobs, from the columns the waiting queue reads of them: the jobs measured or
        resized before are read in full; the others (most: never started) get :func:`unmeasured`, from their
        asked GPUs, batch and steps, rigid unless :meth:`resizable` (a waiting job is no guest)."""
        ids = [row[0] for row in rows]
        ran = {job_id for job_id, points in self.store.speeds(ids).items() if points} | {
            change.job_id for change in self.store.resizes_of(ids)}
        speeds, adaptive = self.models(self.store.jobs_of(sorted(ran)))
        scripts, resizable = self.store.scripts(ids), self._runs_resizable()
        for job_id, kind, _, _, gpus, _, batch, _, steps, _, _ in rows:
            if job_id not in ran:
                rigid = not (resizable and kind == JobKind.FOREGROUND.value and job_id not in scripts)
                speeds[job_id] = unmeasured(gpus, batch, steps, total_gpus=self.total_gpus, rigid=rigid)
        return speeds, adaptive

    def _reserved(self) -> dict[int, int]:
        """The GPUs each job stopping for a resize holds (the more of its two counts)."""
        return {c.job_id: max(c.from_gpus, c.to_gpus) for c in self.store.open_resizes()
                if c.phase == ResizePhase.STOPPING.value}

    # -- carrying resizes on -----------------------------------------------------------------------
    def reconcile(self) -> None:
        """Carry each resize under way one phase on, and read the running jobs' speeds (before the runtime's
        reconcile: an attempt that ended for a resize is the resize's)."""
        for change in self.store.open_resizes():
            job = self.store.job(change.job_id)
            assert job is not None
            if change.phase == ResizePhase.STOPPING.value:
                self._stopping(job, change)
            else:
                self._restarting(job, change)
        for job in self.store.jobs(states=(JobStatus.RUNNING,)):
            if job.kind is JobKind.FOREGROUND and job.host_id is None:
                self._read_speed(job)

    def _stopping(self, job: Job, change: WidthChange) -> None:
        if job.state is not JobStatus.RUNNING:
            self._close(change, ResizePhase.MOOT, f"the job is {job.state.value} before it stopped")
            return
        attempt = self.store.attempts(job.id)
        seen = self.runtime.launcher.observe(job.id, attempt)
        if seen.phase is LaunchPhase.RUNNING:
            self._write_stop(job)  # again: a server killed between the record and the file
            return
        if seen.phase is not LaunchPhase.EXITED:
            if seen.phase is LaunchPhase.LOST:
                self._close(change, ResizePhase.MOOT, "its attempt was lost before it stopped")
            return
        stopped = self.runtime.job_json(job, f"run/{STOPPED}")
        done = count(stopped.get("steps_done")) if isinstance(stopped, dict) else None
        at = count(stopped.get("at")) if isinstance(stopped, dict) else None
        if seen.exit_code != 0 or done is None or at is None:
            why = "it finished first" if seen.exit_code == 0 else f"its attempt exited with code {seen.exit_code}"
            self._close(change, ResizePhase.MOOT, f"{why}, before it stopped")
            return
        self._commit(job, change, int(done), at)

    def _commit(self, job: Job, change: WidthChange, done: int, stopped_at: float) -> None:
        """The old attempt stopped after step ``done``: record it, set the new shape, relaunch (or requeue)."""
        now = self.clock()
        steps, gain = self._converted(job, change, done)
        self.store.update_resize(change.id, ResizePhase.RESTARTING.value, steps_done=done,
                                 checkpoint_s=max(0.0, stopped_at - change.asked_at),
                                 stop_s=max(0.0, now - stopped_at), relaunched_at=now,
                                 attempt=self.store.attempts(job.id) + (1 if change.to_gpus else 0))
        stop_file(self.runtime.launcher.folder, job.id).unlink(missing_ok=True)
        for guest in self.store.jobs(states=(JobStatus.STARTING, JobStatus.RUNNING), host_id=job.id):
            self.store.transition(guest.id, JobStatus.PENDING, f"its host, job {job.id}, was resized: requeued")
        if not change.to_gpus:
            self.store.transition(job.id, JobStatus.PENDING, f"{change.reason} (its checkpoint after step {done})")
            self._close(change, ResizePhase.DONE, f"stopped after step {done}: waits to resume")
            return
        self.store.set_shape(job.id, width=change.to_gpus, batch=change.to_batch, steps=steps, gain=gain)
        self.runtime.relaunch(job, f"resized from {change.from_gpus} to {change.to_gpus} GPUs (batch "
                                   f"{change.to_batch}) from its checkpoint after step {done}")

    def _converted(self, job: Job, change: WidthChange, done: int) -> tuple[int, float | None]:
        """The steps and AdaScale gain of the run at the new batch (steps left scaled by the gains' ratio)."""
        if change.to_batch == change.from_batch:
            return change.from_steps, job.run_gain
        noise = self._noise(job)
        gain = 1.0 if noise is None or change.to_batch == job.batch else adascale_gain(
            change.to_batch, base_batch=job.batch, noise_scale=noise)
        return converted_steps(change.from_steps, done, from_gain=change.from_gain, to_gain=gain), gain

    def _restarting(self, job: Job, change: WidthChange) -> None:
        stop_file(self.runtime.launcher.folder, job.id).unlink(missing_ok=True)  # a server killed before it went
        if job.state is JobStatus.RUNNING and change.attempt is not None and \
                self.store.attempts(job.id) < change.attempt:
            # a server killed between the record and the relaunch: relaunch now
            self.runtime.relaunch(job, f"resized from {change.from_gpus} to {change.to_gpus} GPUs (after a "
                                       "restart of the server)")
            return
        if job.state.terminal or job.state is JobStatus.PENDING:
            self._close(change, ResizePhase.MOOT, f"the job is {job.state.value} before its first step")
            return
        first = self._first_step(job)
        if first is not None and change.steps_done is not None and first[0] > change.steps_done:
            self._done(job, change, first[1])
            return
        seen = self.runtime.launcher.observe(job.id, self.store.attempts(job.id))
        if seen.phase is LaunchPhase.EXITED and seen.exit_code == 0:
            self._close(change, ResizePhase.DONE, "the job finished on its new width")
        elif seen.phase in (LaunchPhase.EXITED, LaunchPhase.LOST):
            self._revert(job, change, seen.exit_code)

    def _first_step(self, job: Job) -> tuple[int, float] | None:
        progress = self.runtime.job_json(job, f"run/{PROGRESS}")
        first = progress.get("first_step") if isinstance(progress, dict) else None
        if not isinstance(first, dict):
            return None
        done, at = count(first.get("steps_done")), count(first.get("at"))
        return None if done is None or at is None else (int(done), at)

    def _done(self, job: Job, change: WidthChange, first_at: float) -> None:
        attempt = self.runtime.job_json(job, ATTEMPT)
        plan_s = count(attempt.get("plan_s")) if isinstance(attempt, dict) else None
        cached = attempt.get("plan_cached") if isinstance(attempt, dict) else None
        launched = change.relaunched_at or first_at
        restart = max(0.0, first_at - launched - (plan_s or 0.0))
        self.store.update_resize(change.id, ResizePhase.DONE.value, plan_s=plan_s,
                                 plan_cached=cached if isinstance(cached, bool) else None, restart_s=restart)
        summary = (f"on {change.to_gpus} GPUs from step {(change.steps_done or 0) + 1}: checkpoint "
                   f"{change.checkpoint_s or 0:.1f} s, stop {change.stop_s or 0:.1f} s, plan {plan_s or 0:.1f} s"
                   f"{' (cached)' if cached is True else ''}, restart {restart:.1f} s")
        self.store.note(job.id, [summary], prefix=f"resize {change.id} done: ")

    def _revert(self, job: Job, change: WidthChange, code: int | None) -> None:
        """The attempt on the new width failed before its first step: back to the last good shape, from the
        same checkpoint."""
        why = "was lost" if code is None else f"exited with code {code}"
        self.store.set_shape(job.id, width=change.from_gpus, batch=change.from_batch, steps=change.from_steps,
                             gain=change.from_gain)
        self._close(change, ResizePhase.REVERTED, f"its attempt on {change.to_gpus} GPUs {why} before its first "
                                                  f"step: back to {change.from_gpus} GPUs from its checkpoint after "
                                                  f"step {change.steps_done}")
        moved = self.store.transition(job.id, JobStatus.PENDING, f"resize to {change.to_gpus} GPUs failed: back "
                                                                 f"to {change.from_gpus}")
        if moved:
            current = self.store.job(job.id)
            assert current is not None
            self.runtime.start(current, f"back on {change.from_gpus} GPUs from its checkpoint after step "
                                        f"{change.steps_done}")

    def _close(self, change: WidthChange, phase: ResizePhase, why: str) -> None:
        """End the resize (its stop file goes: a later attempt must not stop on it)."""
        stop_file(self.runtime.launcher.folder, change.job_id).unlink(missing_ok=True)
        self.store.update_resize(change.id, phase.value)
        self.store.note(change.job_id, [why], prefix=f"resize {change.id} {phase.value.lower()}: ")

    def _write_stop(self, job: Job) -> None:
        path = stop_file(self.runtime.launcher.folder, job.id)
        if path.exists():
            return
        try:
            account = self.runtime.run_as.account(job.owner)
        except DeeppoolError:
            return  # its account is gone: the job fails on its own
        write_private(path, json.dumps({"asked_at": self.clock()}).encode(), account)

    # -- speeds --------------------------------------------------------------------------------------
    def _read_speed(self, job: Job) -> None:
        """The running attempt's measured speed into the database, every :data:`SPEED_EVERY_S` at most."""
        now = self.clock()
        if now - self._read_at.get(job.id, -math.inf) < SPEED_EVERY_S or self.store.resizing(job.id):
            return
        self._read_at[job.id] = now
        attempt = self.runtime.job_json(job, ATTEMPT)
        if not isinstance(attempt, dict) or (attempt.get("gpus"), attempt.get("batch")) != (job.held,
                                                                                           job.current_batch):
            return  # the attempt on this shape has not planned yet: its steps file is an earlier one's
        data = self.runtime.job_file(job, f"run/{STEPS}")
        point = None if data is None else measured(data, job_id=job.id, gpus=job.held, batch=job.current_batch)
        if point is not None:
            self.store.record_speed(point)

    def _noise(self, job: Job) -> float | None:
        points: list[SpeedPoint] = self.store.speeds([job.id])[job.id]
        return next((p.gns for p in reversed(points) if p.gns is not None), None)


def converted_steps(steps: int, done: int, *, from_gain: float, to_gain: float) -> int:
    """The steps a run that did ``done`` of ``steps`` at AdaScale gain ``from_gain`` takes in all at ``to_gain``:
    the same progress in steps at the asked batch (``(steps - done) · from_gain / to_gain`` left, at least one)."""
    left = max(0, steps - done) * from_gain / to_gain
    return done + max(1, math.ceil(left - 1e-9))


def _asked(change: WidthChange) -> str:
    target = "0 GPUs (a resumable preemption)" if not change.to_gpus else f"{change.to_gpus} GPUs"
    return (f"asked: from {change.from_gpus} GPUs to {target}, batch {change.from_batch} -> {change.to_batch}: "
            f"{change.reason}")
