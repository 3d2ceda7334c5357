"""The coordinator's loop: reconcile the processes, then ask the scheduling policy what to start or preempt.

Scheduling decisions come from the same policy the simulator runs
(:class:`deeppool.scheduling.Scheduler`, FIFO with backfilling and background
jobs in their own low-priority queue by default): each tick builds a
:class:`~deeppool.scheduling.Snapshot` from the database and applies the
:class:`~deeppool.scheduling.Decision`:

* ``preempt``: a background job on whole GPUs is stopped (SIGTERM, grace,
  SIGKILL) and requeued, not failed;
* ``start``: the job is claimed and launched. A foreground job started while
  background jobs wait takes the oldest as its guest: it trains in the
  foreground's idle windows through the multiplexer. Guests join at the
  start, because the multiplexer runs beside the foreground's ranks; a
  running foreground job offers no slots to later ones (``free_slots`` is
  empty), which is where this differs from the simulator. A guest's
  processes are started by its host's, so a host takes only a guest whose
  owner's jobs run as the same account (always, unless ``serve --job-user
  submitter``); another user's background job waits for GPUs of its own.

A cancelled job holds its GPUs until its last process is gone
(:meth:`~deeppool.coordinator.runtime.Runtime.lingering`).

Attained service (Tiresias' order) is GPUs × seconds in the current run; a
requeued job starts again from 0.

A tick that fails (whatever the cause) is logged with its traceback and
retried after a growing pause (up to :data:`MAX_RETRY_S`); until a tick
succeeds again :attr:`Service.health` says what failed, and ``/healthz``
answers 503. The first tick, before the server serves, only recovers (it
reconciles; the loop schedules after, so a long queue does not delay serving);
it may fail too: the server starts anyway and the loop keeps trying.

A tick reads the live jobs and the cancelled ones not yet settled, by indexed
queries, never the finished history (:meth:`Store.requeued` and
:meth:`Store.unsettled`).
"""

from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from deeppool.coordinator.jobs import Job, JobKind, JobStatus
from deeppool.coordinator.runtime import Runtime
from deeppool.scheduling import NOTHING, Decision, ModelChoice, Policy, SimJob, Snapshot

LIVE = (JobStatus.STARTING, JobStatus.RUNNING)
MAX_RETRY_S = 5.0
log = logging.getLogger("deeppool.coordinator")


@dataclass(frozen=True, kw_only=True)
class SchedulerHealth:
    ok: bool
    detail: str = ""
    """what failed, and since when (empty when ok)"""


@functools.lru_cache(maxsize=4096)
def model_choice(model: str, batch: int) -> ModelChoice:
    """The policy's view of a job's model (a pure function of the two, kept for the many jobs that share them)."""
    path = Path(model) if model.endswith(".py") else Path(model.replace(".", "/").split(":")[0])
    return ModelChoice(name=path.stem, path=path, global_batch=batch)


def as_sim_job(job: Job) -> SimJob:
    return SimJob(job_id=job.id, name=f"job-{job.id}", arrival_s=job.created_at.timestamp(), gpus=job.gpus,
                  background=job.kind is JobKind.BACKGROUND, iterations=float(job.steps), recorded_duration_s=0.0,
                  model=model_choice(job.model, job.batch))


def snapshot(jobs: list[Job], total_gpus: int, now: datetime, requeued: frozenset[int] = frozenset(),
             lingering: frozenset[int] = frozenset()) -> Snapshot:
    """The policy's view of the database; ``requeued``: the waiting jobs that ran before (preempted);
    ``lingering``: ended jobs some process of which is still there (they hold their GPUs)."""
    waiting = [as_sim_job(j) for j in jobs if j.state is JobStatus.PENDING]
    whole = [j for j in jobs if j.state in LIVE and j.host_id is None]
    running = [as_sim_job(j) for j in whole]
    holding = {j.id: j.gpus for j in whole} | {j.id: j.gpus for j in jobs if j.id in lingering and j.host_id is None}
    preemptible = [job for job in running if job.background]
    attained = {j.id: (now - j.updated_at).total_seconds() * j.gpus for j in jobs if j.state is JobStatus.RUNNING}
    attained.update({job_id: 0.0 for job_id in requeued})
    return Snapshot(
        now_s=now.timestamp(), total_gpus=total_gpus, free_gpus=total_gpus - sum(holding.values()),
        waiting=waiting, waiting_fg=[j for j in waiting if not j.background],
        waiting_bg=[j for j in waiting if j.background], free_slots=(), preemptible=preemptible,
        preemptible_gpus=sum(j.gpus for j in preemptible),
        guests=[as_sim_job(j) for j in jobs if j.state in LIVE and j.host_id is not None],
        holding=holding, running=running, attained_gpu_s=attained,
        requeued=sorted((j for j in waiting if j.job_id in requeued), key=lambda j: (j.arrival_s, j.job_id)),
    )


class Service:
    def __init__(self, runtime: Runtime, policy: Policy, total_gpus: int, *, period_s: float = 0.5,
                 paused: bool = False) -> None:
        """``paused``: keep watching running jobs but start none (to drain the cluster, or queue first)."""
        self.runtime, self.policy, self.total_gpus, self.period_s = runtime, policy, total_gpus, period_s
        self.paused = paused
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="deeppool-coordinator", daemon=True)
        self._failure: SchedulerHealth | None = SchedulerHealth(ok=False, detail="the scheduler has not started")
        self._failing_since: datetime | None = None

    def tick(self, now: datetime | None = None, *, schedule: bool = True) -> Decision:
        """Reconcile the processes, then (``schedule``, unless paused) decide and apply what to start or stop."""
        now = now or datetime.now(UTC)
        self.runtime.reconcile(now)
        if self.paused or not schedule:
            return NOTHING
        store = self.runtime.store
        lingering = frozenset(self.runtime.lingering())
        # the live jobs and the cancelled ones still holding GPUs, from indexes: never the finished history
        jobs = store.jobs(states=(JobStatus.PENDING, *LIVE)) + [j for j in store.unsettled() if j.id in lingering]
        requeued = frozenset(store.requeued())
        decision = self.policy.decide(snapshot(jobs, self.total_gpus, now, requeued, lingering))
        self.apply(decision, {j.id: j for j in jobs})
        return decision

    def apply(self, decision: Decision, jobs: dict[int, Job]) -> None:
        for job_id in decision.preempt:
            self.runtime.requeue(jobs[job_id], f"preempted by the {self.policy.name} policy for foreground work")
        started = {start.job_id for start in decision.start}
        spare = [j for j in jobs.values() if j.state is JobStatus.PENDING and j.kind is JobKind.BACKGROUND
                 and j.id not in started]
        for start in decision.start:
            job = jobs[start.job_id]
            lendable = [g for g in spare if self.runtime.can_host(job, g)]
            guests = [lendable[0]] if job.kind is JobKind.FOREGROUND and lendable else []
            spare = [g for g in spare if g not in guests]
            self.runtime.start(job, f"granted {start.gpus} GPUs by the {self.policy.name} policy", guests)

    @property
    def health(self) -> SchedulerHealth:
        """ok while the loop runs and its last tick succeeded; else what failed."""
        if self._failure is not None:
            return self._failure
        if not self._thread.is_alive():
            return SchedulerHealth(ok=False, detail="the scheduler's thread has ended")
        return SchedulerHealth(ok=True)

    def start(self) -> None:
        # recover before serving: adopt, finalise or relaunch what the last run left; the queue, however long,
        # is scheduled by the loop, so the server serves at once
        self._guarded_tick(schedule=False)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(10)

    def _guarded_tick(self, *, schedule: bool = True) -> bool:
        """One tick; a failure is logged and recorded, never raised. Whether it succeeded."""
        try:
            self.tick(schedule=schedule)
        except Exception as err:  # noqa: BLE001: any failure must leave the loop running, and say so
            log.exception("the scheduling loop failed; retrying")
            self._failing_since = self._failing_since or datetime.now(UTC)
            detail = (f"the scheduling loop has failed since {self._failing_since:%H:%M:%S} UTC "
                      f"({type(err).__name__}: {str(err)[:200]}); retrying")
            self._failure = SchedulerHealth(ok=False, detail=detail)
            return False
        if self._failing_since is not None:
            log.warning("the scheduling loop runs again")
        self._failure = self._failing_since = None
        return True

    def _loop(self) -> None:
        pause = self.period_s
        while not self._stop.wait(pause):
            pause = self.period_s if self._guarded_tick() else min(MAX_RETRY_S, max(pause, self.period_s) * 2)
