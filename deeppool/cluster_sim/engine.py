"""The event loop: a heap of timestamped events around a policy's decisions.

Events are job arrivals, job completions and policy wake-ups. Between two
events every running job progresses at a constant rate (iterations per
second), so the engine only touches a job when its rate changes: it then
banks the progress made, and schedules the job's completion anew (older
completion events carry a stale version and are skipped). After the events
of one instant the engine hands the policy a :class:`Snapshot` and applies its
:class:`Decision`, asking again until the policy has nothing more to do. The
same inputs give the same run: ties break by event kind, then insertion order.

Rates (see :mod:`deeppool.planner.profiling.interference`):

* a job on whole GPUs runs one iteration per ``Plan.iteration_ms`` of its Plan
  on those GPUs, times ``fg_slowdown`` while it hosts a background job; it
  keeps ``gpu_seconds_per_iteration`` of GPU time busy per iteration;
* a background job on lent ranks runs ``min(usable) / T_dp(k)``, each lent rank's idle windows
  weighted by the efficiency for their length and cut to whole pieces of the guest's piece
  (``SimJob.granularity_ms``, the multiplexing mode's: :class:`~deeppool.planner.profiling.interference.Pieces`;
  :meth:`InterferenceModel.usable_fraction`);
* a job started with a batch (a co-adaptive policy's :class:`Start`) runs by its
  :class:`~deeppool.scheduling.contract.SpeedModel` instead: ``goodput(gpus, batch, epoch)``
  progress per second, all its GPUs busy. Its rate changes at each epoch's end (an event) and
  when the policy changes its batch (:class:`Rebatch`, no restart) or its GPUs (a preemption
  and a start: a restart, which pays the penalty).

The engine enforces the contract, whatever the policy: a loan is exactly as
many free lendable ranks as the background job asks for, on GPUs with memory
for it; no job is placed before its arrival; busy GPU-time never exceeds the
cluster. A violation raises :class:`PolicyError` naming the policy. Every
preemption (a policy's decision) and eviction (a guest losing its host) is
counted, and the job pays ``restart_penalty_s`` of lost time when it runs
again. A :class:`Replan` moves a job running a plan to another of its plans on
the same GPUs: its guests are evicted, the new plan's ranks are lent, and it
pays ``replan_penalty_s`` of lost time on all its GPUs.

A snapshot also shows each running job's plan (:class:`PlanState`) and, for
any job, the plans it could run (:class:`PlanOffer`: speed alone and hosting,
the ranks it would lend), both views built from the Plans' facts on demand.
"""

from __future__ import annotations

import bisect
import enum
import heapq
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from deeppool.cluster_sim.cluster import ClusterSpec
from deeppool.cluster_sim.plans import PlanFacts, PlanMode
from deeppool.planner.profiling.interference import InterferenceModel
from deeppool.scheduling.choice import ModelChoice
from deeppool.scheduling.contract import (
    Adaptive, Decision, Lend, PlanOffer, PlanState, Policy, Rebatch, Replan, SimJob, Slot, Snapshot, Start,
)
from deeppool.scheduling.slots import lendable_slots

FactsLookup = Callable[[ModelChoice, int, PlanMode], PlanFacts]
MAX_ROUNDS = 10_000
BUSY_TOLERANCE = 1e-6


def _arrival(job: SimJob) -> tuple[float, int]:
    return job.arrival_s, job.job_id


class EventKind(enum.IntEnum):
    """Order of events at the same instant: completions free resources first."""

    COMPLETION = 0
    ARRIVAL = 1
    WAKE = 2


class PolicyError(RuntimeError):
    """A policy decided something impossible: a bug in the policy, not a user mistake."""


@dataclass(frozen=True, kw_only=True, slots=True)
class JobRecord:
    job_id: int
    name: str
    background: bool
    gpus: int
    arrival_s: float
    start_s: float
    finish_s: float
    work_gpu_s: float
    preemptions: int
    evictions: int

    @property
    def jct_s(self) -> float:
        return self.finish_s - self.arrival_s


@dataclass(frozen=True, kw_only=True)
class SimResult:
    """One policy's run: per-job records, the utilisation timeline and the engine's counters."""

    policy: str
    cluster: ClusterSpec
    records: tuple[JobRecord, ...]
    busy_gpu_s: float
    makespan_s: float
    timeline: tuple[tuple[float, float, float], ...]
    events: int
    decisions: int
    wall_s: float
    preemptions: int = 0
    evictions: int = 0
    restart_penalty_gpu_s: float = 0.0
    lent_gpu_s: float = 0.0
    bg_gpu_s_in_windows: float = 0.0
    replans: int = 0
    replan_gpu_s: float = 0.0


class _Active:
    """A running job (engine-private, mutable)."""

    __slots__ = ("job", "remaining", "rate", "since", "version", "facts", "gpus", "guests", "slots", "busy",
                 "owed_s", "lent", "batch", "mode", "plan_since")

    def __init__(self, job: SimJob, remaining: float, now: float, owed_s: float) -> None:
        self.job = job
        self.remaining = remaining
        self.rate = 0.0
        self.since = now
        self.version = 0
        self.facts: PlanFacts | None = None
        self.gpus = 0
        self.guests: dict[int, int] = {}  # a host's guests: guest id -> its ranks here
        self.slots: tuple[Slot, ...] = ()
        self.busy = 0.0
        self.owed_s = owed_s  # restart penalty still to pay: lost time at the first rate it runs at
        self.lent = 0.0  # lent ranks this guest holds (0 for a job on whole GPUs)
        self.batch: int | None = None  # the global batch of a job run by its speed model
        self.mode: PlanMode | None = None  # the plan of a job on whole GPUs run by its plans
        self.plan_since = now  # its start or its last re-plan


class _AttainedView(Mapping[int, float]):
    """Read-only GPU-seconds of whole-GPU service of every job that has run, live for running jobs.

    A job that never held whole GPUs is absent (Tiresias' policy reads it as 0 and as never run).
    """

    def __init__(self, engine: Simulation) -> None:
        self._engine = engine

    def __getitem__(self, job_id: int) -> float:
        engine = self._engine
        gpus = engine.holding.get(job_id)
        if gpus is None:
            return engine.attained[job_id]
        return engine.attained.get(job_id, 0.0) + gpus * (engine.now - engine.running[job_id].since)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._engine.attained or job_id in self._engine.holding

    def __iter__(self) -> Iterator[int]:
        engine = self._engine
        return iter(dict.fromkeys([*engine.attained, *engine.holding]))

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _AdaptiveView(Mapping[int, Adaptive]):
    """Read-only state of every job that has run by its speed model, live for running jobs."""

    def __init__(self, engine: Simulation) -> None:
        self._engine = engine

    def __getitem__(self, job_id: int) -> Adaptive:
        engine = self._engine
        left = engine.adaptive_left[job_id]
        active = engine.running.get(job_id)
        if active is not None:
            left = max(0.0, active.remaining - active.rate * (engine.now - active.since))
        speed = engine.jobs[job_id].speed
        assert speed is not None
        return Adaptive(progress=speed.total_progress - left, batch=active.batch if active is not None else None,
                        restarts=engine.preemptions.get(job_id, 0), peak_gpus=engine.peak_gpus.get(job_id, 0))

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._engine.adaptive_left

    def __iter__(self) -> Iterator[int]:
        return iter(self._engine.adaptive_left)

    def __len__(self) -> int:
        return len(self._engine.adaptive_left)


class _PlansView(Mapping[int, PlanState]):
    """Read-only plan, age, time left and guests of every job running a plan on whole GPUs, live."""

    def __init__(self, engine: Simulation) -> None:
        self._engine = engine

    def __getitem__(self, job_id: int) -> PlanState:
        engine = self._engine
        active = engine.running[job_id]
        if active.mode is None or active.slots:
            raise KeyError(job_id)
        left = max(0.0, active.remaining - active.rate * (engine.now - active.since))
        hosted = sum(engine.running[guest].busy * ranks / len(engine.running[guest].slots)
                     for guest, ranks in active.guests.items())
        return PlanState(mode=active.mode, since_s=active.plan_since,
                         remaining_s=left / active.rate if active.rate > 0 else math.inf,
                         guests=tuple(active.guests), lent_ranks=sum(active.guests.values()), hosted_rate=hosted)

    def __contains__(self, job_id: object) -> bool:
        active = self._engine.running.get(job_id)  # type: ignore[arg-type]
        return active is not None and active.mode is not None and not active.slots

    def __iter__(self) -> Iterator[int]:
        return (job_id for job_id, active in self._engine.running.items() if active.mode is not None
                and not active.slots)

    def __len__(self) -> int:
        return sum(1 for _ in self)


class _OffersView(Mapping[int, Mapping[PlanMode, PlanOffer]]):
    """The plans every job could run on the GPUs it asks for, built from the Plans' facts on first look."""

    MODES = (PlanMode.DATA_PARALLEL, PlanMode.BURST, PlanMode.LENDING)

    def __init__(self, engine: Simulation) -> None:
        self._engine = engine
        self._memo: dict[tuple[int, int], dict[PlanMode, PlanOffer]] = {}

    def __getitem__(self, job_id: int) -> Mapping[PlanMode, PlanOffer]:
        engine = self._engine
        job = engine.jobs[job_id]
        if job.speed is not None and job_id in engine.adaptive_left:
            raise KeyError(job_id)
        key = (id(job.model), job.gpus)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = {mode: engine.offer(engine._facts(job.model, job.gpus, mode), mode)
                                       for mode in self.MODES}
        return found

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._engine.jobs

    def __iter__(self) -> Iterator[int]:
        return iter(self._engine.jobs)

    def __len__(self) -> int:
        return len(self._engine.jobs)


class Simulation:
    """Runs ``jobs`` on ``cluster`` under ``policy``; ``facts`` gives every Plan's facts.

    ``replan_penalty_s`` (default: ``restart_penalty_s``) is the time a running job loses when a policy moves
    it to another plan (:class:`Replan`).
    """

    def __init__(
        self,
        *,
        cluster: ClusterSpec,
        jobs: Sequence[SimJob],
        policy: Policy,
        facts: FactsLookup,
        interference: InterferenceModel,
        restart_penalty_s: float,
        replan_penalty_s: float | None = None,
        on_progress: Callable[[int], None] = lambda done: None,
    ) -> None:
        self.cluster, self.policy, self.facts, self.model = cluster, policy, facts, interference
        self.restart_penalty_s = restart_penalty_s
        self.replan_penalty_s = restart_penalty_s if replan_penalty_s is None else replan_penalty_s
        self.on_progress = on_progress
        self.jobs = {job.job_id: job for job in jobs}
        self.heap: list[tuple[float, int, int, int, int]] = [
            (job.arrival_s, EventKind.ARRIVAL, index, job.job_id, 0) for index, job in enumerate(jobs)
        ]
        heapq.heapify(self.heap)
        self.seq = len(jobs)
        self.now = 0.0
        self.free = cluster.gpus
        self.waiting: dict[int, SimJob] = {}
        self.waiting_fg: dict[int, SimJob] = {}
        self.waiting_bg: dict[int, SimJob] = {}
        self.requeued: list[SimJob] = []  # waiting jobs that ran before, by (arrival, id)
        self.running: dict[int, _Active] = {}
        self.holding: dict[int, int] = {}
        self.holding_jobs: dict[int, SimJob] = {}
        self.attained: dict[int, float] = {}
        self.remaining: dict[int, float] = {job.job_id: job.iterations for job in jobs}
        self.whole_bg: dict[int, SimJob] = {}
        self.whole_bg_gpus = 0
        self.guests: dict[int, SimJob] = {}
        self.free_slots: dict[tuple[int, int], Slot] = {}
        self.host_slots: dict[int, list[Slot]] = {}
        self.slot_guest: dict[tuple[int, int], int] = {}
        self.first_start: dict[int, float] = {}
        self.preemptions: dict[int, int] = {}
        self.evictions: dict[int, int] = {}
        self.records: list[JobRecord] = []
        self.busy_rate = 0.0
        self.busy_gpu_s = 0.0
        self.lent_rate = 0.0
        self.lent_gpu_s = 0.0
        self.window_rate = 0.0
        self.window_gpu_s = 0.0
        self.penalty_gpu_s = 0.0
        self.replans = 0
        self.replan_gpu_s = 0.0
        self.wakes: set[float] = set()  # wake-ups already scheduled (a second one at the same instant adds nothing)
        self.timeline: list[tuple[float, float, float]] = []
        self.events = 0
        self.decisions = 0
        self._memo: dict[tuple[int, int, PlanMode], PlanFacts] = {}
        self._attained_view = _AttainedView(self)
        self.adaptive_left: dict[int, float] = {}  # progress still to make, of jobs run by their speed model
        self.peak_gpus: dict[int, int] = {}
        self._adaptive_view = _AdaptiveView(self)
        self._plans_view = _PlansView(self)
        self._offers_view = _OffersView(self)

    # ---- the loop -------------------------------------------------------
    def run(self) -> SimResult:
        started = time.perf_counter()
        heap = self.heap
        while self._drop_stale():
            instant = heap[0][0]
            self._advance(instant)
            while self._drop_stale() and heap[0][0] == instant:
                _, kind, _, job_id, _ = heapq.heappop(heap)
                self.events += 1
                self._handle(kind, job_id)
            self._decide()
            self.timeline.append((self.now, self.busy_rate, float(self.cluster.gpus - self.free)))
        return SimResult(
            policy=self.policy.name,
            cluster=self.cluster,
            records=tuple(sorted(self.records, key=lambda r: r.job_id)),
            busy_gpu_s=self.busy_gpu_s,
            makespan_s=self.now,
            timeline=tuple(self.timeline),
            events=self.events,
            decisions=self.decisions,
            wall_s=time.perf_counter() - started,
            preemptions=sum(self.preemptions.values()),
            evictions=sum(self.evictions.values()),
            restart_penalty_gpu_s=self.penalty_gpu_s,
            lent_gpu_s=self.lent_gpu_s,
            bg_gpu_s_in_windows=self.window_gpu_s,
            replans=self.replans,
            replan_gpu_s=self.replan_gpu_s,
        )

    def _advance(self, instant: float) -> None:
        elapsed = instant - self.now
        self.busy_gpu_s += self.busy_rate * elapsed
        self.lent_gpu_s += self.lent_rate * elapsed
        self.window_gpu_s += self.window_rate * elapsed
        self.now = instant

    def _push(self, at: float, kind: EventKind, job_id: int, version: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (at, kind, self.seq, job_id, version))

    def _drop_stale(self) -> bool:
        """Pop completions made stale by a rate change; True while an event is left."""
        heap = self.heap
        while heap and heap[0][1] == EventKind.COMPLETION:
            active = self.running.get(heap[0][3])
            if active is not None and active.version == heap[0][4]:
                break
            heapq.heappop(heap)
        return bool(heap)

    def _handle(self, kind: int, job_id: int) -> None:
        if kind == EventKind.WAKE:
            self.wakes.discard(self.now)
        elif kind == EventKind.ARRIVAL:
            self._enqueue(self.jobs[job_id])
        elif kind == EventKind.COMPLETION:
            active = self.running[job_id]
            if active.batch is not None and not self._finished(active):
                self._rate_adaptive(active)  # an epoch ended: its gain changes
            else:
                self._complete(active)

    def _finished(self, active: _Active) -> bool:
        self._bank(active)
        speed = active.job.speed
        assert speed is not None
        return active.remaining <= speed.total_progress * 1e-9

    def _snapshot(self, round_: int) -> Snapshot:
        return Snapshot(
            now_s=self.now,
            total_gpus=self.cluster.gpus,
            free_gpus=self.free,
            waiting=self.waiting.values(),
            waiting_fg=self.waiting_fg.values(),
            waiting_bg=self.waiting_bg.values(),
            free_slots=self.free_slots.values(),
            preemptible=self.whole_bg.values(),
            preemptible_gpus=self.whole_bg_gpus,
            guests=self.guests.values(),
            holding=self.holding,
            running=self.holding_jobs.values(),
            requeued=self.requeued,
            attained_gpu_s=self._attained_view,
            adaptive=self._adaptive_view,
            round=round_,
            plans=self._plans_view,
            offers=self._offers_view,
            replan_cost_s=self.replan_penalty_s,
        )

    def _decide(self) -> None:
        for round_ in range(MAX_ROUNDS):
            decision = self.policy.decide(self._snapshot(round_))
            self.decisions += 1
            if decision.wake_at_s is not None and decision.wake_at_s > self.now and decision.wake_at_s not in self.wakes:
                self.wakes.add(decision.wake_at_s)
                self._push(decision.wake_at_s, EventKind.WAKE, -1, 0)
            if decision.empty:
                return
            self._apply(decision)
        raise PolicyError(f"policy '{self.policy.name}' kept deciding for {MAX_ROUNDS} rounds at t={self.now:.0f}s")

    def _apply(self, decision: Decision) -> None:
        for job_id in decision.preempt:
            self._preempt(job_id)
        for replan in decision.replan:
            self._replan(replan)
        for start in decision.start:
            self._start(start)
        for lend in decision.lend:
            self._lend(lend)
        for rebatch in decision.rebatch:
            self._rebatch(rebatch)
        if self.busy_rate > self.cluster.gpus * (1 + BUSY_TOLERANCE):
            raise PolicyError(
                f"policy '{self.policy.name}' made {self.busy_rate:.2f} of {self.cluster.gpus} GPUs busy "
                f"({self.busy_rate / self.cluster.gpus:.0%}) at t={self.now:.0f}s"
            )

    def _fail(self, problem: str) -> PolicyError:
        return PolicyError(f"policy '{self.policy.name}' {problem} at t={self.now:.0f}s")

    # ---- queue ----------------------------------------------------------
    def _enqueue(self, job: SimJob) -> None:
        self.waiting[job.job_id] = job
        (self.waiting_bg if job.background else self.waiting_fg)[job.job_id] = job

    def _requeue(self, job: SimJob) -> None:
        self._enqueue(job)
        bisect.insort(self.requeued, job, key=_arrival)

    def _unrequeue(self, job: SimJob) -> None:
        index = bisect.bisect_left(self.requeued, _arrival(job), key=_arrival)
        del self.requeued[index]

    def _dequeue(self, job_id: int) -> SimJob:
        job = self.waiting.pop(job_id, None)
        if job is None:
            known = self.jobs.get(job_id)
            if known is not None and known.arrival_s > self.now:
                raise self._fail(f"placed job {job_id} before its arrival at t={known.arrival_s:.0f}s")
            raise self._fail(f"placed job {job_id}, which is not waiting")
        (self.waiting_bg if job.background else self.waiting_fg).pop(job_id)
        if job_id in self.first_start:
            self._unrequeue(job)
        self.first_start.setdefault(job_id, self.now)
        return job

    def _owed_s(self, job_id: int) -> float:
        """The restart penalty a job pays when it runs again after a preemption or eviction."""
        stopped = self.preemptions.get(job_id, 0) + self.evictions.get(job_id, 0)
        return self.restart_penalty_s if stopped and self.restart_penalty_s > 0 else 0.0

    # ---- transitions ----------------------------------------------------
    def _start(self, start: Start) -> None:
        if start.gpus > self.free or start.gpus < 1:
            raise self._fail(f"started job {start.job_id} on {start.gpus} GPUs, {self.free} free")
        job = self._dequeue(start.job_id)
        active = _Active(job, self._left(job, start), self.now, self._owed_s(job.job_id))
        active.gpus = start.gpus
        if start.batch is None:
            active.facts = self._facts(job.model, start.gpus, start.mode)
            active.mode = start.mode
        else:
            active.batch = start.batch
            self.peak_gpus[job.job_id] = max(start.gpus, self.peak_gpus.get(job.job_id, 0))
        self.free -= start.gpus
        self.running[job.job_id] = active
        self.holding[job.job_id] = start.gpus
        self.holding_jobs[job.job_id] = job
        self.penalty_gpu_s += active.owed_s * start.gpus
        if job.background and active.batch is None:
            self.whole_bg[job.job_id] = job
            self.whole_bg_gpus += start.gpus
        elif active.batch is None:
            self._open_slots(active)
        if active.batch is None:
            self._rate_whole(active)
        else:
            self._rate_adaptive(active)

    def _left(self, job: SimJob, start: Start) -> float:
        """Work left: plan iterations, or, started with a batch, progress of its speed model (never both)."""
        adaptive = job.job_id in self.adaptive_left
        if start.batch is None:
            if adaptive:
                raise self._fail(f"started job {job.job_id} without a batch; it has run by its speed model")
            return self.remaining[job.job_id]
        if job.speed is None:
            raise self._fail(f"started job {job.job_id} with a batch; it has no speed model (a Pollux workload job)")
        if not adaptive and job.job_id in self.first_start and self.first_start[job.job_id] < self.now:
            raise self._fail(f"started job {job.job_id} with a batch; it has run by its Plans")
        self._check_batch(job, start.gpus, start.batch)
        return self.adaptive_left.setdefault(job.job_id, job.speed.total_progress)

    def _check_batch(self, job: SimJob, gpus: int, batch: int) -> None:
        speed = job.speed
        assert speed is not None
        epoch = speed.epoch_at(speed.total_progress - self.adaptive_left.get(job.job_id, speed.total_progress))
        if gpus > speed.max_gpus or not speed.goodput(gpus, batch, epoch) > 0:
            raise self._fail(f"ran job {job.job_id} at batch {batch} on {gpus} GPUs, which its speed model cannot")

    def _rebatch(self, rebatch: Rebatch) -> None:
        active = self.running.get(rebatch.job_id)
        if active is None or active.batch is None:
            raise self._fail(f"changed the batch of job {rebatch.job_id}, which is not running by its speed model")
        self._bank(active)
        self.adaptive_left[rebatch.job_id] = active.remaining
        self._check_batch(active.job, active.gpus, rebatch.batch)
        active.batch = rebatch.batch
        self._rate_adaptive(active)

    def _replan(self, replan: Replan) -> None:
        """Move a job running a plan on whole GPUs to another plan: its guests are evicted, its ranks lent
        anew, and it loses ``replan_penalty_s`` on all its GPUs."""
        active = self.running.get(replan.job_id)
        if active is None or active.mode is None or active.slots:
            raise self._fail(f"re-planned job {replan.job_id}, which is not running a plan on whole GPUs")
        if replan.mode is active.mode:
            raise self._fail(f"re-planned job {replan.job_id} to the plan it runs ({replan.mode.value})")
        self._bank(active)
        self._close_slots(replan.job_id)
        active.guests = {}
        active.facts = self._facts(active.job.model, active.gpus, replan.mode)
        active.mode, active.plan_since = replan.mode, self.now
        active.owed_s += self.replan_penalty_s
        self.replans += 1
        self.replan_gpu_s += self.replan_penalty_s * active.gpus
        if not active.job.background:
            self._open_slots(active)
        self._rate_whole(active)

    def lendable(self, facts: PlanFacts, host: int) -> list[Slot]:
        """The ranks of a plan that are lent (to ``host``'s guests), most idle first: idle for at least
        ``min_lend_fraction`` of an iteration, with windows background work fills in pieces of the mode's
        nominal piece (``bg_piece_ms``)."""
        capacity = self.cluster.device_model.memory_bytes
        return lendable_slots(host, facts.idle_fractions, facts.windows_ms, facts.iteration_s * 1e3, self.model,
                              free_memory=lambda rank: capacity - facts.rank_memory(rank))

    def offer(self, facts: PlanFacts, mode: PlanMode) -> PlanOffer:
        """A plan as a policy weighs it (:class:`PlanOffer`): its speed alone and hosting, its lendable ranks."""
        ranks = sorted(self.lendable(facts, -1), key=lambda slot: -slot.usable_fraction)
        value = [0.0]
        for slot in ranks:
            value.append(value[-1] + slot.usable_fraction)
        return PlanOffer(mode=mode, iteration_s=facts.iteration_s,
                         hosting_iteration_s=facts.iteration_s * self.model.fg_slowdown, lendable=tuple(ranks),
                         lendable_value=tuple(value))

    def _open_slots(self, host: _Active) -> None:
        assert host.facts is not None
        slots = self.lendable(host.facts, host.job.job_id)
        self.host_slots[host.job.job_id] = slots
        for slot in slots:
            self.free_slots[(slot.host, slot.rank)] = slot

    def _lend(self, lend: Lend) -> None:
        keys = [(slot.host, slot.rank) for slot in lend.slots]
        if not keys or any(key not in self.free_slots for key in keys) or len(set(keys)) != len(keys):
            raise self._fail(f"lent job {lend.job_id} ranks that are not free lendable ranks")
        wanted = self.jobs[lend.job_id].gpus if lend.job_id in self.jobs else None
        if wanted is not None and len(keys) != wanted:
            raise self._fail(f"lent job {lend.job_id} {len(keys)} idle rank(s); it runs on exactly {wanted}")
        job = self._dequeue(lend.job_id)
        if not job.background:
            raise self._fail(f"lent idle ranks to foreground job {job.job_id}")
        self._check_fit(job, lend.slots)
        active = _Active(job, self.remaining[job.job_id], self.now, self._owed_s(job.job_id))
        active.slots = tuple(lend.slots)
        self.penalty_gpu_s += active.owed_s * len(keys)
        self.running[job.job_id] = active
        self.guests[job.job_id] = job
        for key in keys:
            del self.free_slots[key]
            self.slot_guest[key] = job.job_id
        for host_id in dict.fromkeys(slot.host for slot in lend.slots):
            host = self.running[host_id]
            host.guests[job.job_id] = sum(1 for slot in lend.slots if slot.host == host_id)
            if len(host.guests) == 1:
                self._rate_whole(host)
        self._rate_guest(active)

    def _check_fit(self, job: SimJob, slots: tuple[Slot, ...]) -> None:
        """Each lent GPU must hold the guest's rank in memory and its step pieces in a window."""
        for slot in slots:
            if slot.free_memory_bytes < job.memory_bytes:
                raise self._fail(
                    f"lent job {job.job_id} rank {slot.rank} of job {slot.host}: its rank needs "
                    f"{job.memory_bytes / 2**30:.1f} GiB, the GPU has {slot.free_memory_bytes / 2**30:.1f} GiB free"
                )
            if slot.longest_window_ms < job.granularity_ms:
                raise self._fail(
                    f"lent job {job.job_id} rank {slot.rank} of job {slot.host}: its longest window "
                    f"({slot.longest_window_ms:.2f} ms) holds none of the job's {job.granularity_ms:.2f} ms steps"
                )

    def _preempt(self, job_id: int) -> None:
        active = self.running.get(job_id)
        if active is None:
            raise self._fail(f"preempted job {job_id}, which is not running")
        self._stop(active)
        self.preemptions[job_id] = self.preemptions.get(job_id, 0) + 1
        self._requeue(active.job)

    def _complete(self, active: _Active) -> None:
        job = self._stop(active)
        self.remaining[job.job_id] = 0.0
        self.records.append(
            JobRecord(
                job_id=job.job_id,
                name=job.name,
                background=job.background,
                gpus=job.gpus,
                arrival_s=job.arrival_s,
                start_s=self.first_start[job.job_id],
                finish_s=self.now,
                work_gpu_s=job.work_gpu_s,
                preemptions=self.preemptions.get(job.job_id, 0),
                evictions=self.evictions.get(job.job_id, 0),
            )
        )
        if len(self.records) % 256 == 0:
            self.on_progress(len(self.records))

    def _stop(self, active: _Active) -> SimJob:
        """Take ``active`` off the cluster, banking its progress; evict its guests."""
        job = active.job
        self._bank(active)
        if active.batch is None:
            self.remaining[job.job_id] = active.remaining
        else:
            self.adaptive_left[job.job_id] = active.remaining
        self.busy_rate -= active.busy
        self.lent_rate -= active.lent
        if active.lent:
            self.window_rate -= active.busy
        del self.running[job.job_id]
        if active.slots:
            del self.guests[job.job_id]
            self._release_slots(active)
            if not self.guests:  # the sums of added and removed rates leave a residue that long runs add up
                self.lent_rate = self.window_rate = 0.0
        else:
            self.free += active.gpus
            del self.holding[job.job_id]
            del self.holding_jobs[job.job_id]
            if job.job_id in self.whole_bg:
                del self.whole_bg[job.job_id]
                self.whole_bg_gpus -= active.gpus
            self._close_slots(job.job_id)
        return job

    def _close_slots(self, host_id: int) -> None:
        for slot in self.host_slots.pop(host_id, ()):
            key = (slot.host, slot.rank)
            self.free_slots.pop(key, None)
            guest_id = self.slot_guest.get(key)
            if guest_id is not None and guest_id in self.running:
                self._stop(self.running[guest_id])
                self.evictions[guest_id] = self.evictions.get(guest_id, 0) + 1
                self._requeue(self.jobs[guest_id])
            self.slot_guest.pop(key, None)

    def _release_slots(self, guest: _Active) -> None:
        for slot in guest.slots:
            key = (slot.host, slot.rank)
            self.slot_guest.pop(key, None)
            if slot.host in self.host_slots:
                self.free_slots[key] = slot
        for host_id in dict.fromkeys(slot.host for slot in guest.slots):
            host = self.running.get(host_id)
            if host is not None and host_id in self.host_slots:
                del host.guests[guest.job.job_id]
                if not host.guests:
                    self._rate_whole(host)

    # ---- rates ----------------------------------------------------------
    def _facts(self, model: ModelChoice, gpus: int, mode: PlanMode) -> PlanFacts:
        """``facts`` memoised by model identity (jobs share their ModelChoice; hashing one is slow)."""
        key = (id(model), gpus, mode)
        found = self._memo.get(key)
        if found is None:
            found = self._memo[key] = self.facts(model, gpus, mode)
        return found

    def _bank(self, active: _Active) -> None:
        elapsed = self.now - active.since
        active.remaining = max(0.0, active.remaining - active.rate * elapsed)
        if not active.slots:
            job_id = active.job.job_id
            self.attained[job_id] = self.attained.get(job_id, 0.0) + active.gpus * elapsed
        active.since = self.now

    def _set_rate(self, active: _Active, rate: float, busy: float, until: float = 0.0) -> None:
        """Run ``active`` at ``rate``; its next event when ``until`` work is left (0: its completion)."""
        self._bank(active)
        if active.owed_s:
            active.remaining += rate * active.owed_s
            active.owed_s = 0.0
        self.busy_rate += busy - active.busy
        if active.lent:
            self.window_rate += busy - active.busy
        active.rate, active.busy = rate, busy
        active.version = self.seq + 1  # unique across restarts: a stale completion never matches
        self._push(self.now + max(0.0, active.remaining - until) / rate, EventKind.COMPLETION, active.job.job_id,
                   active.version)

    def _rate_adaptive(self, active: _Active) -> None:
        """goodput(gpus, batch, epoch) progress per second, all its GPUs busy, until its epoch ends."""
        speed = active.job.speed
        assert speed is not None and active.batch is not None
        self._bank(active)
        total = speed.total_progress
        epoch = speed.epoch_at(total - active.remaining)
        rate = speed.goodput(active.gpus, active.batch, epoch)
        self._set_rate(active, rate, float(active.gpus), until=max(0.0, total - speed.progress_at(epoch + 1)))

    def _rate_whole(self, active: _Active) -> None:
        facts = active.facts
        assert facts is not None
        slowdown = self.model.fg_slowdown if active.guests else 1.0
        rate = 1.0 / (facts.iteration_s * slowdown)
        self._set_rate(active, rate, facts.gpu_seconds_per_iteration * rate)

    def _rate_guest(self, active: _Active) -> None:
        """Progress only in the lent windows: the least usable lent rank sets the pace (synchronous DP)."""
        job = active.job
        own = self._facts(job.model, job.gpus, PlanMode.DATA_PARALLEL)
        share = min(self._usable(slot, job.granularity_ms) for slot in active.slots)
        active.lent = float(len(active.slots))
        self.lent_rate += active.lent
        rate = share / own.iteration_s
        self._set_rate(active, rate, own.gpu_seconds_per_iteration * rate)

    def _usable(self, slot: Slot, granularity_ms: float) -> float:
        host = self.running[slot.host].facts
        assert host is not None
        return self.model.usable_fraction(host.windows_ms(slot.rank), host.iteration_s * 1e3,
                                          piece_ms=granularity_ms)
