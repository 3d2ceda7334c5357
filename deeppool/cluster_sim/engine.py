"""The event loop: a heap of timestamped events around a policy's decisions.

Events are job arrivals, job completions and policy wake-ups. Between two
events every running job progresses at a constant rate (iterations per
second), so the engine only touches a job when its rate changes: it then
banks the progress made, and schedules the job's completion anew (older
completion events carry a stale version and are skipped). After the events
of one instant the engine hands the policy a :class:`Snapshot` and applies its
:class:`Decision`, asking again until the policy has nothing more to do. The
same inputs give the same run: ties break by event kind, then insertion order.

Rates (see :mod:`deeppool.cluster_sim.interference`):

* a job on whole GPUs runs one iteration per ``Plan.iteration_ms`` of its Plan
  on those GPUs, times ``fg_slowdown`` while it hosts a background job; it
  keeps ``gpu_seconds_per_iteration`` of GPU time busy per iteration;
* a background job on lent ranks runs ``min(usable) / T_dp(k)``, each lent rank's idle windows
  weighted by the efficiency for their length.
"""

from __future__ import annotations

import enum
import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deeppool.cluster_sim.cluster import ClusterSpec
from deeppool.cluster_sim.interference import InterferenceModel
from deeppool.cluster_sim.models import ModelChoice
from deeppool.cluster_sim.plans import PlanFacts, PlanMode
from deeppool.cluster_sim.policy import Decision, Lend, Policy, SimJob, Slot, Snapshot, Start

FactsLookup = Callable[[ModelChoice, int, PlanMode], PlanFacts]
MAX_ROUNDS = 10_000


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


class _Active:
    """A running job (engine-private, mutable)."""

    __slots__ = ("job", "remaining", "rate", "since", "version", "facts", "gpus", "guests", "slots", "busy")

    def __init__(self, job: SimJob, remaining: float, now: float) -> None:
        self.job = job
        self.remaining = remaining
        self.rate = 0.0
        self.since = now
        self.version = 0
        self.facts: PlanFacts | None = None
        self.gpus = 0
        self.guests = 0
        self.slots: tuple[Slot, ...] = ()
        self.busy = 0.0


class Engine:
    """Runs ``jobs`` on ``cluster`` under ``policy``; ``facts`` gives every Plan's facts."""

    def __init__(
        self,
        *,
        cluster: ClusterSpec,
        jobs: Sequence[SimJob],
        policy: Policy,
        facts: FactsLookup,
        interference: InterferenceModel,
        on_progress: Callable[[int], None] = lambda done: None,
    ) -> None:
        self.cluster, self.policy, self.facts, self.model = cluster, policy, facts, interference
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
        self.running: dict[int, _Active] = {}
        self.remaining: dict[int, float] = {job.job_id: job.iterations for job in jobs}
        self.whole_bg: dict[int, SimJob] = {}
        self.whole_bg_gpus = 0
        self.guests: dict[int, SimJob] = {}
        self.free_slots: dict[tuple[int, int], Slot] = {}
        self.host_slots: dict[int, list[Slot]] = {}
        self.slot_guest: dict[tuple[int, int], int] = {}
        self.first_start: dict[int, float] = {}
        self.preemptions: dict[int, int] = {}
        self.records: list[JobRecord] = []
        self.busy_rate = 0.0
        self.busy_gpu_s = 0.0
        self.timeline: list[tuple[float, float, float]] = []
        self.events = 0
        self.decisions = 0
        self._memo: dict[tuple[int, int, PlanMode], PlanFacts] = {}

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
        )

    def _advance(self, instant: float) -> None:
        self.busy_gpu_s += self.busy_rate * (instant - self.now)
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
        if kind == EventKind.ARRIVAL:
            self._enqueue(self.jobs[job_id])
        elif kind == EventKind.COMPLETION:
            self._complete(self.running[job_id])

    def _decide(self) -> None:
        for _ in range(MAX_ROUNDS):
            snapshot = Snapshot(
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
            )
            decision = self.policy.decide(snapshot)
            self.decisions += 1
            if decision.wake_at_s is not None and decision.wake_at_s > self.now:
                self._push(decision.wake_at_s, EventKind.WAKE, -1, 0)
            if decision.empty:
                return
            self._apply(decision)
        raise PolicyError(f"policy '{self.policy.name}' kept deciding for {MAX_ROUNDS} rounds at t={self.now:.0f}s")

    def _apply(self, decision: Decision) -> None:
        for job_id in decision.preempt:
            self._preempt(job_id)
        for start in decision.start:
            self._start(start)
        for lend in decision.lend:
            self._lend(lend)

    # ---- queue ----------------------------------------------------------
    def _enqueue(self, job: SimJob) -> None:
        self.waiting[job.job_id] = job
        (self.waiting_bg if job.background else self.waiting_fg)[job.job_id] = job

    def _dequeue(self, job_id: int) -> SimJob:
        job = self.waiting.pop(job_id, None)
        if job is None:
            raise PolicyError(f"policy '{self.policy.name}' placed job {job_id}, which is not waiting")
        (self.waiting_bg if job.background else self.waiting_fg).pop(job_id)
        self.first_start.setdefault(job_id, self.now)
        return job

    # ---- transitions ----------------------------------------------------
    def _start(self, start: Start) -> None:
        if start.gpus > self.free or start.gpus < 1:
            raise PolicyError(f"policy '{self.policy.name}' started job {start.job_id} on {start.gpus} GPUs, {self.free} free")
        job = self._dequeue(start.job_id)
        active = _Active(job, self.remaining[job.job_id], self.now)
        active.facts = self._facts(job.model, start.gpus, start.mode)
        active.gpus = start.gpus
        self.free -= start.gpus
        self.running[job.job_id] = active
        if job.background:
            self.whole_bg[job.job_id] = job
            self.whole_bg_gpus += start.gpus
        else:
            self._open_slots(active)
        self._rate_whole(active)

    def _open_slots(self, host: _Active) -> None:
        assert host.facts is not None
        facts = host.facts
        idle = facts.idle_fractions
        ranks = sorted(range(len(idle)), key=lambda r: -idle[r])
        usable = {r: self.model.usable_fraction(facts.windows_ms(r), facts.iteration_s * 1e3) for r in ranks}
        slots = [  # a rank whose windows background work cannot fill is not lent
            Slot(host=host.job.job_id, rank=r, idle_fraction=idle[r], usable_fraction=usable[r])
            for r in ranks
            if idle[r] >= self.model.min_lend_fraction and usable[r] > 0
        ]
        self.host_slots[host.job.job_id] = slots
        for slot in slots:
            self.free_slots[(slot.host, slot.rank)] = slot

    def _lend(self, lend: Lend) -> None:
        keys = [(slot.host, slot.rank) for slot in lend.slots]
        if not keys or any(key not in self.free_slots for key in keys) or len(set(keys)) != len(keys):
            raise PolicyError(f"policy '{self.policy.name}' lent job {lend.job_id} slots that are not free")
        job = self._dequeue(lend.job_id)
        if not job.background:
            raise PolicyError(f"policy '{self.policy.name}' lent idle ranks to foreground job {job.job_id}")
        active = _Active(job, self.remaining[job.job_id], self.now)
        active.slots = tuple(lend.slots)
        self.running[job.job_id] = active
        self.guests[job.job_id] = job
        for key in keys:
            del self.free_slots[key]
            self.slot_guest[key] = job.job_id
        for host_id in dict.fromkeys(slot.host for slot in lend.slots):
            host = self.running[host_id]
            host.guests += 1
            if host.guests == 1:
                self._rate_whole(host)
        self._rate_guest(active)

    def _preempt(self, job_id: int) -> None:
        job = self.whole_bg.get(job_id) or self.guests.get(job_id)
        if job is None:
            raise PolicyError(f"policy '{self.policy.name}' preempted job {job_id}, which is no running background job")
        self._stop(self.running[job_id])
        self.preemptions[job_id] = self.preemptions.get(job_id, 0) + 1
        self._enqueue(job)

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
            )
        )
        if len(self.records) % 256 == 0:
            self.on_progress(len(self.records))

    def _stop(self, active: _Active) -> SimJob:
        """Take ``active`` off the cluster, banking its progress; evict its guests."""
        job = active.job
        self._bank(active)
        self.remaining[job.job_id] = active.remaining
        self.busy_rate -= active.busy
        del self.running[job.job_id]
        if active.slots:
            del self.guests[job.job_id]
            self._release_slots(active)
        else:
            self.free += active.gpus
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
                self._enqueue(self.jobs[guest_id])
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
                host.guests -= 1
                if host.guests == 0:
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
        active.remaining = max(0.0, active.remaining - active.rate * (self.now - active.since))
        active.since = self.now

    def _set_rate(self, active: _Active, rate: float, busy: float) -> None:
        self._bank(active)
        self.busy_rate += busy - active.busy
        active.rate, active.busy = rate, busy
        active.version = self.seq + 1  # unique across restarts: a stale completion never matches
        self._push(self.now + active.remaining / rate, EventKind.COMPLETION, active.job.job_id, active.version)

    def _rate_whole(self, active: _Active) -> None:
        facts = active.facts
        assert facts is not None
        slowdown = self.model.fg_slowdown if active.guests else 1.0
        rate = 1.0 / (facts.iteration_s * slowdown)
        self._set_rate(active, rate, facts.gpu_seconds_per_iteration * rate)

    def _rate_guest(self, active: _Active) -> None:
        job = active.job
        own = self._facts(job.model, job.gpus, PlanMode.DATA_PARALLEL)
        share = min(slot.usable_fraction for slot in active.slots)
        rate = share / own.iteration_s
        self._set_rate(active, rate, own.gpu_seconds_per_iteration * rate)
