"""``burst+demand``: plans chosen for the background that is waiting, and background jobs that keep their place.

**Order.** First come, first served over every job, foreground and background alike, as ``dp`` runs it:
the earliest waiting job starts when its GPUs are free. No job is demoted. Behind a head that cannot
start, *conservative backfilling*: every job from the head on, in order, reserves the earliest time its
GPUs are free for its predicted run (its iterations on its fastest plan, against the running jobs'
predicted ends), and a job whose reservation is now starts now, so a later job never delays an earlier
one's reservation. A background job may, besides, run *ahead of its turn*: on whole GPUs nobody earlier
is waiting for, and on the idle ranks of running foreground plans. The GPUs it holds ahead of its turn
are taken back (a preemption, newest first) as soon as a job that arrived before it needs them, and
when its turn comes a guest on lent ranks moves to whole GPUs.

**Plans.** A foreground job runs one of two plans (:class:`~deeppool.scheduling.contract.PlanOffer`):
the fastest (``burst``) or the one chosen for the cluster's throughput with an unlimited supply of
background work (``lending``). Each is weighed by the cluster objective with its supply capped at the
background that is waiting (:func:`deeppool.planner.profiling.interference.cluster_shares`), in
data-parallel GPU-seconds per second of the job's ``G`` GPUs:

    rate(plan, 0) = G · T_dp / T_plan                                               (nothing lent)
    rate(plan, k) = G · T_dp / (T_plan · fg_slowdown) + Σ_{its k most usable ranks} usable_r

with ``k`` = min(its lendable ranks, the GPUs of the background jobs waiting). With none waiting a job
gets its fastest plan; it starts on the lending plan only when that beats the fastest by ``margin``.

**Loans.** A host that hosts already lends its free ranks to any waiting background job that fits (its
slowdown is paid). A host that does not starts to only when the ranks the waiting jobs would fill are
worth more than its slowdown costs, by ``margin``; at a tick, a host whose guests are worth less than
its slowdown, by ``margin``, sends them back to the queue (where they keep their place).

**Re-plans, with hysteresis.** At every tick (``tick_s``) a foreground job without guests that has kept
its plan for ``dwell_s`` moves to its other plan when, for the demand waiting then, the other's best
rate ``r'`` beats its own ``r`` by ``margin`` and pays for the move within the dwell:
``(r' − r) · min(dwell_s, its time left) ≥ r' · replan_cost_s`` (the snapshot's re-plan cost). A plan is
kept at least ``dwell_s``, so a job re-plans at most once a dwell whatever the background does.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterator, Mapping
from itertools import chain
from dataclasses import dataclass, field

from deeppool.planner.profiling.interference import cluster_shares
from deeppool.scheduling.contract import (
    NOTHING, Decision, Lend, PlanMode, PlanOffer, PlanState, Replan, SimJob, Slot, Snapshot, Start,
)

DEFAULT_MARGIN = 0.02
DEFAULT_DWELL_S = 600.0
DEFAULT_TICK_S = 300.0
BACKFILL_DEPTH = 64
"""Jobs from the head on that backfilling reserves for before it stops looking (each decision)."""
UNFIT_DEPTH = 64
"""Waiting background jobs a loan looks past (their pieces fit no free window, or their memory no GPU)."""
CHOICES = (PlanMode.BURST, PlanMode.LENDING)
"""The plans a foreground job moves between: the fastest, and the one that lends for an unlimited supply."""


def _arrival(job: SimJob) -> tuple[float, int]:
    return job.arrival_s, job.job_id


@dataclass(frozen=True, kw_only=True)
class Hysteresis:
    """When a plan or a loan changes: by ``margin`` at least, a plan kept ``dwell_s``, re-plans every ``tick_s``."""

    margin: float = DEFAULT_MARGIN
    dwell_s: float = DEFAULT_DWELL_S
    tick_s: float = DEFAULT_TICK_S

    def __post_init__(self) -> None:
        if self.margin < 0 or self.dwell_s < 0 or self.tick_s <= 0:
            raise ValueError(f"hysteresis needs margin and dwell >= 0 and tick > 0, not {self}")


def rate(offer: PlanOffer, *, dp_iteration_s: float, gpus: int, claimed: int) -> float:
    """The host's work rate on ``offer`` with its ``claimed`` most usable ranks lent (the module's formula)."""
    claimed = max(0, min(claimed, len(offer.lendable)))
    fg, bg = cluster_shares(dp_ms=dp_iteration_s, iteration_ms=offer.iteration_s,
                            hosting_ms=offer.hosting_iteration_s, gpus=gpus, lent_usable=offer.lendable_value[claimed])
    return gpus * (fg + bg)


def best_rate(offer: PlanOffer, *, dp_iteration_s: float, gpus: int, demand: int) -> tuple[float, int]:
    """(rate, ranks lent) of ``offer`` for ``demand`` waiting background ranks: lent when that is faster."""
    alone = rate(offer, dp_iteration_s=dp_iteration_s, gpus=gpus, claimed=0)
    claimed = min(demand, len(offer.lendable))
    if claimed > 0:
        lent = rate(offer, dp_iteration_s=dp_iteration_s, gpus=gpus, claimed=claimed)
        if lent > alone:
            return lent, claimed
    return alone, 0


def best_plan(offers: Mapping[PlanMode, PlanOffer], *, gpus: int, demand: int, margin: float,
              keep: PlanMode = PlanMode.BURST) -> tuple[PlanMode, float, int]:
    """The plan of :data:`CHOICES` with the best rate for ``demand`` waiting background ranks: ``keep``
    unless another beats it by ``margin``. Returns (mode, its rate, the ranks it would lend)."""
    dp = offers[PlanMode.DATA_PARALLEL].iteration_s
    scored = {mode: best_rate(offers[mode], dp_iteration_s=dp, gpus=gpus, demand=demand) for mode in CHOICES}
    mode = keep
    for other, (value, _) in scored.items():
        if value > scored[mode][0] * (1 + margin):
            mode = other
    return mode, *scored[mode]


@dataclass(frozen=True, kw_only=True)
class DemandPolicy:
    """``burst+demand`` (the module docstring): a pure ``decide(snapshot) -> Decision``."""

    hysteresis: Hysteresis = field(default_factory=Hysteresis)
    name: str = "burst+demand"

    def decide(self, snapshot: Snapshot) -> Decision:
        turn = _Decision(snapshot, self.hysteresis)
        turn.admit()
        turn.ahead()
        turn.backfill()
        lend = turn.lend()
        replan, release = turn.retune() if turn.ticking else ((), ())
        starts = turn.starts()
        preempt = (*turn.preempt, *release)
        lending = any(start.mode is PlanMode.LENDING for start in starts) or \
            any(move.mode is PlanMode.LENDING for move in replan)
        wake = turn.next_tick() if lending or turn.lending or turn.waiting or turn.snapshot.guests else None
        if not (preempt or starts or lend or replan):
            return Decision(wake_at_s=wake) if wake is not None else NOTHING
        return Decision(preempt=preempt, start=starts, lend=lend, replan=replan, wake_at_s=wake)


class _Decision:
    """One decision of :class:`DemandPolicy`: the queue's turns, then what runs ahead of them."""

    def __init__(self, snapshot: Snapshot, hysteresis: Hysteresis) -> None:
        self.snapshot, self.hysteresis = snapshot, hysteresis
        self.free = snapshot.free_gpus
        self.preempt: list[int] = []
        self.admitted: list[SimJob] = []  # to start on whole GPUs, in order
        self.started: set[int] = set()
        self.demand: Iterator[SimJob] = iter(())  # background jobs left waiting, in queue order (lazily)
        self.demand_ranks = 0  # their GPUs (at least), less those lent this decision
        self.waiting = False  # whether background jobs wait for lent ranks (before this decision lends any)
        self.lending = False  # whether a tick found a job on its lending plan (a later tick may move it back)
        self.head: SimJob | None = None  # the first job that cannot start: the queue waits behind it
        self.rest: Iterator[tuple[SimJob, bool]] | None = None  # the queue behind the head

    @property
    def ticking(self) -> bool:
        s = self.snapshot
        return s.round == 0 and s.now_s > 0 and s.now_s % self.hysteresis.tick_s == 0 and bool(s.running)

    def next_tick(self) -> float:
        """The next tick: re-plans are weighed then (asked for only while background waits or is hosted, or a
        job runs its lending plan, which a later tick may take back)."""
        tick = self.hysteresis.tick_s
        return (math.floor(self.snapshot.now_s / tick) + 1) * tick

    # ---- the queue's turns ----------------------------------------------
    def _queue(self) -> Iterator[tuple[SimJob, bool]]:
        """Every waiting job and every guest by arrival, lazily: (job, whether it is a guest on lent ranks)."""
        s = self.snapshot
        requeued = s.requeued
        if not requeued and not s.guests:
            return ((job, False) for job in s.waiting)

        def fresh() -> Iterator[tuple[SimJob, bool]]:
            for job in s.waiting:
                index = bisect.bisect_left(requeued, _arrival(job), key=_arrival)
                if index == len(requeued) or requeued[index].job_id != job.job_id:
                    yield job, False

        guests = sorted(s.guests, key=_arrival)
        return heapq.merge(fresh(), ((job, False) for job in requeued), ((job, True) for job in guests),
                           key=lambda pair: _arrival(pair[0]))

    def admit(self) -> None:
        """Start waiting jobs by arrival while their GPUs are free (taken back from background jobs ahead of
        their turn if need be), move a guest whose turn has come to whole GPUs, and stop at the first job
        that cannot start."""
        queue = self._queue()
        for job, guest in queue:
            if job.gpus > self.free and not self._reclaim(job):
                self.head, self.rest = job, queue
                return
            self.free -= job.gpus
            if guest:
                self.preempt.append(job.job_id)  # it restarts on whole GPUs next round, in its turn
            else:
                self.admitted.append(job)
                self.started.add(job.job_id)

    def _reclaim(self, job: SimJob) -> bool:
        """Preempt background jobs that arrived after ``job``, newest first, until it fits; False if it cannot."""
        s = self.snapshot
        if self.free + s.preemptible_gpus < job.gpus:
            return False
        arrival = _arrival(job)
        victims = [v for v in s.preemptible if _arrival(v) > arrival and v.job_id not in self.preempt]
        if self.free + sum(s.holding[v.job_id] for v in victims) < job.gpus:
            return False
        for victim in sorted(victims, key=_arrival, reverse=True):
            self.preempt.append(victim.job_id)
            self.free += s.holding[victim.job_id]
            if self.free >= job.gpus:
                return True
        raise AssertionError("the victims hold enough GPUs")

    # ---- ahead of their turn --------------------------------------------
    def ahead(self) -> None:
        """Background jobs still waiting: on free whole GPUs, in queue order; the rest are the demand for lent
        ranks, counted as their number (each asks for a GPU at least) and read lazily when ranks are lent."""
        s = self.snapshot
        queue = iter(s.waiting_bg)
        skipped: list[SimJob] = []
        if self.free > 0:
            for job in queue:
                if job.job_id not in self.started:
                    if job.gpus <= self.free:
                        self.free -= job.gpus
                        self.admitted.append(job)
                        self.started.add(job.job_id)
                    else:
                        skipped.append(job)
                if self.free <= 0:
                    break
        started = sum(1 for job in self.admitted if job.background)
        self.demand_ranks = len(s.waiting_bg) - started
        self.waiting = self.demand_ranks > 0
        self.demand = chain(skipped, (job for job in queue if job.job_id not in self.started))

    def backfill(self) -> None:
        """Conservative backfilling: GPUs left free behind a blocked head start a later job only where that
        delays no earlier job. Every job from the head on, in queue order, reserves the earliest time its GPUs
        are free for its predicted run (its fastest plan's iterations) in a profile of the running jobs'
        predicted ends; a job whose reservation is now starts now. Background jobs ahead of their turn count
        as free GPUs (they are taken back when needed)."""
        head, s = self.head, self.snapshot
        if head is None or self.free <= 0 or self.rest is None:
            return
        profile = self._profile(head)
        for count, (job, guest) in enumerate(chain([(head, False)], self.rest)):
            if self.free <= 0 or count >= BACKFILL_DEPTH:
                return
            if job.job_id in self.started:
                continue  # a background job started ahead of its turn this decision
            offers = s.offers.get(job.job_id)
            if offers is None:
                return
            duration = job.iterations * offers[PlanMode.BURST].iteration_s
            at = profile.earliest(job.gpus, duration)
            profile.reserve(at, duration, job.gpus)
            if at <= s.now_s and not guest and job.gpus <= self.free:
                self.free -= job.gpus
                self.admitted.append(job)
                self.started.add(job.job_id)

    def _profile(self, head: SimJob) -> _Profile:
        """Free GPUs from now on, by the running jobs' predicted ends (background jobs that arrived after the
        head, and those starting ahead of their turn now, count as free)."""
        s = self.snapshot
        ahead = {job.job_id for job in s.preemptible if _arrival(job) > _arrival(head)}
        free = self.free + sum(s.holding.get(j, 0) for j in ahead) + sum(j.gpus for j in self.admitted if j.background)
        ends = [(s.now_s + state.remaining_s, s.holding[job_id]) for job_id, state in s.plans.items()
                if job_id not in ahead and job_id not in self.preempt]
        return _Profile(s.now_s, free, ends)

    def lend(self) -> tuple[Lend, ...]:
        """The demand on lent ranks: hosts that host already first, then hosts whose loans pay for their slowdown."""
        s = self.snapshot
        if self.demand_ranks <= 0 or not s.free_slots:
            return ()
        by_host: dict[int, list[Slot]] = {}
        for slot in s.free_slots:
            by_host.setdefault(slot.host, []).append(slot)
        hosting = [host for host in by_host if _hosts(s, host)]
        lends = self._fill([slot for host in hosting for slot in by_host[host]])
        for host in by_host:
            if self.demand_ranks <= 0:
                break
            if host not in hosting and self._pays(host, by_host[host]):
                lends += self._fill(by_host[host])
        return tuple(lends)

    def _fill(self, slots: list[Slot]) -> list[Lend]:
        """Lend the demand, in queue order, the smallest-window ranks of ``slots`` that fit each job (looking at
        most :data:`UNFIT_DEPTH` jobs past the last that fits)."""
        if not slots:
            return []
        slots = sorted(slots, key=lambda slot: (slot.longest_window_ms, slot.host, slot.rank))
        windows = [slot.longest_window_ms for slot in slots]
        lends: list[Lend] = []
        unfit: list[SimJob] = []
        for job in self.demand:
            chosen = fitting(slots, windows, job)
            if chosen is None:
                unfit.append(job)
            else:
                lends.append(Lend(job_id=job.job_id, slots=chosen))
                self.demand_ranks -= job.gpus
            if not slots or len(unfit) >= UNFIT_DEPTH:
                break
        self.demand = chain(unfit, self.demand)
        return lends

    def _pays(self, host: int, slots: list[Slot]) -> bool:
        """Whether lending ``slots`` of a host that hosts nothing to the demand beats its slowdown by the margin."""
        s = self.snapshot
        offers, gpus, state = s.offers.get(host), s.holding.get(host), s.plans.get(host)
        if offers is None or gpus is None or state is None:
            return True  # nothing known of its plans: lend, as burst+bg does
        offer, dp = offers[state.mode], offers[PlanMode.DATA_PARALLEL].iteration_s
        usable = sorted((slot.usable_fraction for slot in slots), reverse=True)[:self.demand_ranks]
        fg, bg = cluster_shares(dp_ms=dp, iteration_ms=offer.iteration_s, hosting_ms=offer.hosting_iteration_s,
                                gpus=gpus, lent_usable=sum(usable))
        return fg + bg > dp / offer.iteration_s * (1 + self.hysteresis.margin)

    # ---- plans ----------------------------------------------------------
    def starts(self) -> tuple[Start, ...]:
        """This decision's starts: a foreground job on the plan best for the demand still waiting."""
        out = []
        for job in self.admitted:
            offers = None if job.background else self.snapshot.offers.get(job.job_id)
            mode = PlanMode.BURST
            if offers is not None:
                mode, _, lent = best_plan(offers, gpus=job.gpus, demand=self.demand_ranks,
                                          margin=self.hysteresis.margin)
                self.demand_ranks -= lent
            out.append(Start(job_id=job.job_id, gpus=job.gpus, mode=mode))
        return tuple(out)

    def retune(self) -> tuple[tuple[Replan, ...], tuple[int, ...]]:
        """At a tick: guests sent back from hosts whose loans no longer pay for their slowdown, and re-plans
        of foreground jobs without guests (the module's rule)."""
        s = self.snapshot
        replans, release = [], []
        for job in s.running:
            host = job.job_id
            if job.background or host in self.preempt:
                continue
            offers = s.offers.get(host)
            if offers is None or _settled(offers, self.hysteresis.margin):
                continue
            state = s.plans.get(host)
            if state is not None and state.mode is PlanMode.LENDING:
                self.lending = True
            if state is None or (not state.guests and s.now_s - state.since_s < self.hysteresis.dwell_s):
                continue  # kept for its dwell
            if not state.guests and state.mode is PlanMode.BURST and (
                    self.demand_ranks <= 0 or not offers[PlanMode.LENDING].lendable):
                continue  # the fastest plan, and nothing waiting or nothing the other plan lends: nothing to weigh
            if state.guests:
                release += self._release(state, offers, job.gpus)
            else:
                moved = self._replan(host, state, offers, job.gpus)
                if moved is not None:
                    replans.append(moved)
        return tuple(replans), tuple(dict.fromkeys(g for g in release if g not in self.preempt))

    def _release(self, state: PlanState, offers: Mapping[PlanMode, PlanOffer], gpus: int) -> list[int]:
        offer, dp = offers[state.mode], offers[PlanMode.DATA_PARALLEL].iteration_s
        slowed = gpus * dp / offer.iteration_s - gpus * dp / offer.hosting_iteration_s
        return list(state.guests) if state.hosted_rate * (1 + self.hysteresis.margin) < slowed else []

    def _replan(self, host: int, state: PlanState, offers: Mapping[PlanMode, PlanOffer], gpus: int) -> Replan | None:
        h = self.hysteresis
        dp = offers[PlanMode.DATA_PARALLEL].iteration_s
        current, _ = best_rate(offers[state.mode], dp_iteration_s=dp, gpus=gpus, demand=self.demand_ranks)
        mode, other, lent = best_plan(offers, gpus=gpus, demand=self.demand_ranks, margin=h.margin, keep=state.mode)
        if mode is state.mode or (other - current) * min(h.dwell_s, state.remaining_s) < other * self.snapshot.replan_cost_s:
            return None
        self.demand_ranks -= lent
        return Replan(job_id=host, mode=mode)


class _Profile:
    """Free GPUs over time as a step function: ``free[i]`` from ``times[i]`` until ``times[i + 1]``."""

    def __init__(self, now: float, free: int, ends: list[tuple[float, int]]) -> None:
        self.times, self.free = [now], [free]
        for at, gpus in sorted(ends):
            if at > self.times[-1]:
                self.times.append(at)
                self.free.append(self.free[-1])
            self.free[-1] += gpus

    def earliest(self, gpus: int, duration: float) -> float:
        """The first breakpoint from which ``gpus`` stay free for ``duration`` (inf: never)."""
        times, free = self.times, self.free
        for i, start in enumerate(times):
            j = i
            while j < len(times) and times[j] < start + duration and free[j] >= gpus:
                j += 1
            if j == len(times) or times[j] >= start + duration:
                return start
        return math.inf

    def reserve(self, start: float, duration: float, gpus: int) -> None:
        if math.isinf(start):
            return
        for at in (start, start + duration):
            index = bisect.bisect_right(self.times, at)
            if self.times[index - 1] != at:
                self.times.insert(index, at)
                self.free.insert(index, self.free[index - 1])
        for index in range(bisect.bisect_left(self.times, start), bisect.bisect_left(self.times, start + duration)):
            self.free[index] -= gpus


def _settled(offers: Mapping[PlanMode, PlanOffer], margin: float) -> bool:
    """Whether no demand can ever move a job with these plans: neither lends a rank, and they run within
    ``margin`` of each other (no re-plan, no loan to weigh)."""
    burst, lending = offers[PlanMode.BURST], offers[PlanMode.LENDING]
    return not burst.lendable and not lending.lendable and lending.iteration_s <= burst.iteration_s * (1 + margin)


def _hosts(snapshot: Snapshot, host: int) -> bool:
    state = snapshot.plans.get(host)
    return state is not None and bool(state.guests)


def fitting(slots: list[Slot], windows: list[float], job: SimJob) -> tuple[Slot, ...] | None:
    """Take the ``job.gpus`` smallest-window slots that fit ``job`` out of ``slots`` (sorted by window)."""
    chosen: list[int] = []
    for index in range(bisect.bisect_left(windows, job.granularity_ms), len(slots)):
        if slots[index].fits(job):
            chosen.append(index)
            if len(chosen) == job.gpus:
                break
    if len(chosen) < job.gpus:
        return None
    taken = tuple(slots[index] for index in chosen)
    for index in reversed(chosen):
        del slots[index]
        del windows[index]
    return taken
