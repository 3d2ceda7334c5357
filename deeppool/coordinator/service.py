"""The coordinator's loop: reconcile the processes, then ask the scheduling policy what to start or preempt.

Scheduling decisions come from the same policy the simulator runs
(:class:`deeppool.scheduling.Scheduler`, FIFO with backfilling and background
jobs in their own low-priority queue by default): each tick builds a
:class:`~deeppool.scheduling.Snapshot` from the database and applies the
:class:`~deeppool.scheduling.Decision`:

* ``preempt``: a background job on whole GPUs is stopped (SIGTERM, grace,
  SIGKILL) and requeued, not failed;
* ``start``: the job is claimed and launched. A foreground job started while
  background jobs wait takes the oldest as its guest at its start only when
  that guest is not lent to it once it has planned (another account's, whose
  broker the host's supervisor sets up with the host; or a host over several
  nodes);
* ``lend``: the snapshot's ``free_slots`` are the idle ranks of running
  foreground jobs (:meth:`Lending.free_slots
  <deeppool.coordinator.lending.Lending.free_slots>`, from their plans), and a
  loan makes the background job a guest of the running host: its ranks pick
  it up at their next step boundary (:mod:`deeppool.coordinator.lending`).
  A guest leaves while its host runs when it has trained its steps, or is
  cancelled or preempted.

A cancelled job holds its GPUs until its last process is gone
(:meth:`~deeppool.coordinator.runtime.Runtime.lingering`).

With an :class:`~deeppool.coordinator.elastic.Elastic` (a co-adaptive policy:
``serve --policy pollux``), a decision that preempts a running job and starts
it again on other GPUs, or changes its batch, resizes it from a checkpoint;
the snapshot then carries each job's speed model learned from its runs and
its adaptive state, and a policy that asked to be woken at an instant
(Pollux's interval) decides at that instant, a tick late at most.

Attained service (Tiresias' order) is GPUs × seconds in the current run; a
requeued job starts again from 0.

A tick that fails (whatever the cause) is logged with its traceback and
retried after a growing pause (up to :data:`MAX_RETRY_S`); until a tick
succeeds again :attr:`Service.health` says what failed, and ``/healthz``
answers 503. The first tick, before the server serves, only recovers (it
reconciles; the loop schedules after, so a long queue does not delay serving);
it may fail too: the server starts anyway and the loop keeps trying.

A tick reads the live jobs and the cancelled ones not yet settled, by indexed
queries, never the finished history (:meth:`Store.unsettled`); of the waiting
jobs, those the events since the last tick moved (each read once, then kept
while it waits: :mod:`deeppool.coordinator.waiting`), and a validated
:class:`~deeppool.coordinator.jobs.Job` only for those a decision names
(:class:`TickJobs`). Under an elastic policy the same holds: the waiting jobs'
speed models and adaptive state are made when the queue reads a job and kept
while it waits (:mod:`deeppool.coordinator.waiting_models`); a resize that
reshapes a waiting job, and a speed measured for one, are events that read it
again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from deeppool.coordinator.elastic import Elastic, ElasticView
from deeppool.coordinator.jobs import Job, JobKind, JobStatus
from deeppool.coordinator.runtime import Runtime
from deeppool.coordinator.store import Store
from deeppool.coordinator.waiting import Queue, Waiting, WaitingJobs, model_choice
from deeppool.scheduling import NOTHING, Decision, Lend, Policy, SimJob, Slot, Snapshot, SpeedModel, Start

LIVE = (JobStatus.STARTING, JobStatus.RUNNING)
MAX_RETRY_S = 5.0
log = logging.getLogger("deeppool.coordinator")


@dataclass(frozen=True, kw_only=True)
class SchedulerHealth:
    ok: bool
    detail: str = ""
    """what failed, and since when (empty when ok)"""


def as_sim_job(job: Job, speed: SpeedModel | None = None) -> SimJob:
    return SimJob(job_id=job.id, name=f"job-{job.id}", arrival_s=job.created_at.timestamp(), gpus=job.held,
                  background=job.kind is JobKind.BACKGROUND, iterations=float(job.steps), recorded_duration_s=0.0,
                  model=model_choice(job.model, job.current_batch), speed=speed)


def snapshot(jobs: list[Job], total_gpus: int, now: datetime, requeued: frozenset[int] = frozenset(),
             lingering: frozenset[int] = frozenset(), free_slots: tuple[Slot, ...] = (),
             elastic: ElasticView | None = None) -> Snapshot:
    """The policy's view of ``jobs`` (waiting, live and lingering ones); ``requeued``: the waiting jobs that ran
    before (preempted); ``lingering``: ended jobs some process of which is still there (they hold their GPUs);
    ``free_slots``: the idle ranks running foreground jobs lend (:meth:`Lending.free_slots`); ``elastic``: the
    jobs' speed models and adaptive state, and the GPUs a job being resized holds (:meth:`Elastic.view`)."""
    waiting = Queue.of({j.id: Waiting.of_job(j, j.id in requeued) for j in jobs if j.state is JobStatus.PENDING})
    live = [j for j in jobs if j.state is not JobStatus.PENDING]
    return policy_view(live, waiting, total_gpus, now, lingering, free_slots, elastic)


def policy_view(live: list[Job], waiting: Queue, total_gpus: int, now: datetime,
                lingering: frozenset[int] = frozenset(), free_slots: tuple[Slot, ...] = (),
                elastic: ElasticView | None = None) -> Snapshot:
    """:func:`snapshot` from the live and lingering jobs as rows and the waiting ones as the tick keeps them
    (:class:`~deeppool.coordinator.waiting.Queue`, under an elastic policy with their speed models): the policy
    gets copies of its lists, made anew only when ``elastic`` gives waiting jobs speed models (as
    :meth:`Elastic.view <deeppool.coordinator.elastic.Elastic.view>` of full rows does)."""
    elastic = elastic or ElasticView()
    speeds = elastic.speeds
    if any(job_id in waiting.jobs for job_id in speeds):
        waiting = Queue.of({job_id: replace(w, sim=replace(w.sim, speed=speeds[job_id])) if job_id in speeds else w
                            for job_id, w in waiting.jobs.items()})
    whole = [j for j in live if j.state in LIVE and j.host_id is None]
    running = [as_sim_job(j, speeds.get(j.id)) for j in whole]
    holding = {j.id: elastic.reserved.get(j.id, j.held) for j in whole} | {
        j.id: j.held for j in live if j.id in lingering and j.host_id is None}
    preemptible = [job for job in running if job.background]
    attained = {j.id: (now - j.updated_at).total_seconds() * j.held for j in live if j.state is JobStatus.RUNNING}
    attained.update({job.job_id: 0.0 for job in waiting.requeued})
    return Snapshot(
        now_s=now.timestamp(), total_gpus=total_gpus, free_gpus=total_gpus - sum(holding.values()),
        waiting=list(waiting.sims), waiting_fg=list(waiting.foreground), waiting_bg=list(waiting.background),
        free_slots=free_slots, preemptible=preemptible, preemptible_gpus=sum(j.gpus for j in preemptible),
        guests=[as_sim_job(j) for j in live if j.state in LIVE and j.host_id is not None],
        holding=holding, running=running, attained_gpu_s=attained, requeued=list(waiting.requeued),
        adaptive=elastic.adaptive,
    )


class TickJobs(Mapping[int, Job]):
    """The jobs one tick decides about, by id: the live and lingering ones as read, a waiting one read in full
    (a validated :class:`Job`) only when the decision names it."""

    def __init__(self, store: Store, live: list[Job], waiting: Queue) -> None:
        self.store = store
        self._rows = {j.id: j for j in live}
        self._waiting = waiting.jobs

    def __getitem__(self, job_id: int) -> Job:
        row = self._rows.get(job_id)
        if row is None and job_id in self._waiting:
            row = self.store.job(job_id)
            if row is not None:
                self._rows[job_id] = row
        if row is None:
            raise KeyError(job_id)
        return row

    def __iter__(self) -> Iterator[int]:
        return iter(self._rows.keys() | self._waiting.keys())

    def __len__(self) -> int:
        return len(self._rows.keys() | self._waiting.keys())

    def waiting(self) -> list[Waiting]:
        return list(self._waiting.values())


class Service:
    def __init__(self, runtime: Runtime, policy: Policy, total_gpus: int, *, period_s: float = 0.5,
                 paused: bool = False, elastic: Elastic | None = None) -> None:
        """``paused``: keep watching running jobs but start none (to drain the cluster, or queue first);
        ``elastic``: resize running jobs as the policy says (:mod:`deeppool.coordinator.elastic`)."""
        self.runtime, self.policy, self.total_gpus, self.period_s = runtime, policy, total_gpus, period_s
        self.paused, self.elastic = paused, elastic
        self.waiting = WaitingJobs(runtime.store, elastic.waiting if elastic is not None else None)
        self._wake: float | None = None  # the instant the policy last asked to decide at
        self._deferred: tuple[Start, ...] = ()  # starts decided while their GPUs were still held (see apply)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="deeppool-coordinator", daemon=True)
        self._failure: SchedulerHealth | None = SchedulerHealth(ok=False, detail="the scheduler has not started")
        self._failing_since: datetime | None = None

    def tick(self, now: datetime | None = None, *, schedule: bool = True) -> Decision:
        """Reconcile the processes, then (``schedule``, unless paused) decide and apply what to start or stop."""
        now = now or datetime.now(UTC)
        if self.elastic is not None:
            self.elastic.reconcile()  # first: an attempt that ended for a resize is the resize's
        self.runtime.reconcile(now)
        if self.paused or not schedule:
            return NOTHING
        store = self.runtime.store
        lingering = frozenset(self.runtime.lingering())
        # the live jobs and the cancelled ones still holding GPUs, from indexes: never the finished history; the
        # waiting ones as few columns, each turned into the policy's view once (:mod:`.waiting`)
        live = store.jobs(states=LIVE) + [j for j in store.unsettled() if j.id in lingering]
        self.runtime.lending.sync(live)
        slots = tuple(self.runtime.lending.free_slots(live))
        waiting = self.waiting.read()  # under an elastic policy, with its speed models (made as it reads them)
        view = self.elastic.view_of(live) if self.elastic is not None else ElasticView()
        decision = self.policy.decide(policy_view(live, waiting, self.total_gpus, self._instant(now), lingering,
                                                  slots, view))
        self._wake = decision.wake_at_s
        self.apply(decision, TickJobs(store, live, waiting))
        return decision

    def _instant(self, now: datetime) -> datetime:
        """``now``, or the instant the policy asked to be woken at once it has passed: a policy that decides at
        set instants (Pollux's interval) sees its instant, at most a tick late, as in the simulator."""
        if self._wake is not None and self._wake <= now.timestamp():
            return datetime.fromtimestamp(self._wake, UTC)
        return now

    def apply(self, decision: Decision, jobs: TickJobs) -> None:
        """Resize, preempt, start and lend as ``decision`` says. A start whose GPUs a job still holds (one
        stopping to shrink in the same decision, say) waits: it is tried again at each tick whose decision starts
        nothing, until it fits or a decision starts other jobs; no GPU is ever given twice."""
        resized = self.elastic.apply(decision, jobs, self.policy.name) if self.elastic is not None else set()
        for job_id in [job_id for job_id in decision.preempt if job_id not in resized]:
            self.runtime.requeue(jobs[job_id], f"preempted by the {self.policy.name} policy for foreground work")
        starts = [start for start in decision.start if start.job_id not in resized] or list(self._deferred)
        taken = {start.job_id for start in starts} | {lend.job_id for lend in decision.lend}
        spare = [w for w in jobs.waiting() if w.kind is JobKind.BACKGROUND] if starts else []
        free, deferred = self._free_gpus() if starts else 0, []
        for start in starts:
            job = self.runtime.store.job(start.job_id)  # its shape as the policy set it
            if job is None or job.state is not JobStatus.PENDING:
                continue
            if start.gpus > free:
                deferred.append(start)  # its GPUs are still held by a job stopping for a resize
                continue
            free -= start.gpus
            guest = self._guest(job, spare, taken, jobs) if job.kind is JobKind.FOREGROUND else None
            if guest is not None:
                taken.add(guest.id)
            self.runtime.start(job, f"granted {start.gpus} GPUs by the {self.policy.name} policy",
                               [guest] if guest is not None else [])
        self._deferred = tuple(deferred)
        for lend in decision.lend:
            self._lend(lend, jobs)

    def _free_gpus(self) -> int:
        """The GPUs no job holds now: a job stopping or restarting for a resize holds the larger of its two
        widths until its resize ends, and a cancelled job holds its own until its processes are gone."""
        store = self.runtime.store
        reserved = {change.job_id: max(change.from_gpus, change.to_gpus) for change in store.open_resizes()}
        lingering = frozenset(self.runtime.lingering())
        holders = store.jobs(states=LIVE) + [j for j in store.unsettled() if j.id in lingering]
        return self.total_gpus - sum(reserved.get(j.id, j.held) for j in holders if j.host_id is None)

    def _guest(self, host: Job, spare: list[Waiting], taken: set[int], jobs: TickJobs) -> Job | None:
        """The oldest waiting background job, not ``taken``, that ``host`` takes as its guest at its start: one
        it may host that is given at its start (:meth:`~deeppool.coordinator.lending.Lending.given_at_start`,
        not lent once it has planned). Both depend on the guest's owner only, so one row of
        each owner is read in full."""
        fits: dict[str, bool] = {}
        for waiting in spare:
            if waiting.id in taken:
                continue
            if waiting.owner not in fits:
                guest = jobs.get(waiting.id)
                if guest is None:
                    continue  # it left the queue since the tick read it
                fits[waiting.owner] = self.runtime.can_host(host, guest) and self.runtime.lending.given_at_start(
                    host, guest)
            if fits[waiting.owner]:
                found = jobs.get(waiting.id)
                if found is not None:
                    return found
        return None

    def _lend(self, lend: Lend, jobs: Mapping[int, Job]) -> None:
        """A policy's loan of running hosts' idle ranks: the guest joins the host that holds its first rank."""
        guest, host = jobs.get(lend.job_id), jobs.get(lend.slots[0].host) if lend.slots else None
        if guest is None or host is None or guest.state is not JobStatus.PENDING \
                or not self.runtime.lending.joins(host, guest):
            return
        ranks = tuple(sorted(slot.rank for slot in lend.slots if slot.host == host.id))
        self.runtime.lending.lend(guest, host, ranks, f"lent rank{'s' * (len(ranks) > 1)} "
                                  f"{', '.join(map(str, ranks))} of running job {host.id} by the "
                                  f"{self.policy.name} policy")

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
