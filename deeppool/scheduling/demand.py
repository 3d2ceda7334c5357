"""``burst+demand``: plans chosen for the background that is waiting, and background jobs that keep their place.

**Order.** First come, first served over every job, foreground and background alike, as ``dp`` runs it:
the earliest waiting job starts when its GPUs are free, and while it cannot, the queue waits behind it.
No job is demoted. A background job may, besides, run *ahead of its turn*: on whole GPUs nobody earlier
is waiting for, and on the idle ranks of running foreground plans. The GPUs it holds ahead of its turn
are taken back (a preemption, newest first) as soon as a job that arrived before it needs them, and
when its turn comes a guest on lent ranks moves to whole GPUs. What a background job does ahead of its
turn is a gain; it never loses its place to a job that arrived later.

**Plans.** A foreground job runs one of its plans (:class:`~deeppool.scheduling.contract.PlanOffer`):
the fastest (``burst``) or the one chosen for the cluster's throughput with an unlimited supply of
background work (``lending``). Each is weighed by the cluster objective with its supply capped at the
background that is waiting and fits (:func:`deeppool.planner.profiling.interference.claimed_throughput`),
in data-parallel GPU-seconds per second of the job's ``G`` GPUs:

    rate(plan, k) = G · T_dp / T_plan                                    (k = 0: nothing lent)
                  = G · T_dp / (T_plan · fg_slowdown) + Σ_{k most usable ranks} usable_r   (k > 0)

with ``k`` the lendable ranks the waiting background jobs fill. With none waiting a job gets its
fastest plan; it starts on the lending plan only when that beats the fastest by ``margin``.

**Loans.** A host that already hosts lends its free ranks to any waiting background job that fits
(the slowdown is paid already). A host that does not starts to only when the ranks the waiting demand
fills are worth more than the slowdown costs it, by ``margin``; at a tick, a host whose guests are
worth less than its slowdown by ``margin`` sends them back to the queue (where they keep their place).

**Re-plans, with hysteresis.** Every ``tick_s`` a foreground job without guests that has kept its plan
for ``dwell_s`` moves to its other plan when, for the demand waiting now, the other's rate ``r'``
beats its own ``r`` by ``margin`` and pays for the move within the dwell:
``(r' − r) · min(dwell_s, time left) ≥ r' · replan_cost_s``. The re-plan cost is the snapshot's
(the simulator's ``--replan-penalty``). A plan is kept at least ``dwell_s`` once chosen, so a job
re-plans at most once per dwell whatever the background does.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from deeppool.planner.profiling.interference import claimed_throughput
from deeppool.scheduling.contract import (
    NOTHING, Decision, Lend, PlanMode, PlanOffer, PlanState, Replan, SimJob, Slot, Snapshot, Start,
)

DEFAULT_MARGIN = 0.02
DEFAULT_DWELL_S = 600.0
DEFAULT_TICK_S = 300.0
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
            raise ValueError(f"hysteresis needs margin, dwell >= 0 and tick > 0, not {self}")


def rate(offer: PlanOffer, *, dp_iteration_s: float, gpus: int, claimed: int) -> float:
    """The host's work rate on ``offer`` with ``claimed`` ranks lent (the module's formula)."""
    fg, bg = claimed_throughput(dp_ms=dp_iteration_s, iteration_ms=offer.iteration_s,
                                hosting_ms=offer.hosting_iteration_s, gpus=gpus,
                                usable=_Usable(offer), claimed=claimed)
    return gpus * (fg + bg)


class _Usable(Sequence[float]):
    """An offer's lendable ranks' usable fractions, whose prefix sums the offer already holds."""

    def __init__(self, offer: PlanOffer) -> None:
        self._offer = offer

    def __len__(self) -> int:
        return len(self._offer.lendable)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if start == 0 and step == 1:
                return _Prefix(self._offer.lendable_value[stop])
            return [slot.usable_fraction for slot in self._offer.lendable[index]]
        return self._offer.lendable[index].usable_fraction


class _Prefix(Sequence[float]):
    """A prefix whose sum is known: ``sum()`` of it reads the offer's prefix sum (no loop over the ranks)."""

    def __init__(self, total: float) -> None:
        self.total = total

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index):  # type: ignore[override]
        return self.total

    def __iter__(self) -> Iterator[float]:
        yield self.total


def best_plan(offers: Mapping[PlanMode, PlanOffer], *, gpus: int, demand: int, margin: float,
              prefer: PlanMode = PlanMode.BURST) -> tuple[PlanMode, float, int]:
    """The plan of ``CHOICES`` with the best rate for ``demand`` waiting background ranks (lent or not),
    ``prefer``'s unless another beats it by ``margin``: (mode, rate, ranks it would lend)."""
    dp = offers[PlanMode.DATA_PARALLEL].iteration_s
    scored = {mode: _best_rate(offers[mode], dp=dp, gpus=gpus, demand=demand) for mode in CHOICES}
    mode = prefer
    for other, (value, _) in scored.items():
        if value > scored[mode][0] * (1 + margin):
            mode = other
    return mode, *scored[mode]


def _best_rate(offer: PlanOffer, *, dp: float, gpus: int, demand: int) -> tuple[float, int]:
    """(rate, ranks lent) of ``offer`` lent to ``demand`` ranks' worth of background, or not lent."""
    alone = rate(offer, dp_iteration_s=dp, gpus=gpus, claimed=0)
    claimed = min(demand, len(offer.lendable))
    if claimed == 0:
        return alone, 0
    lent = rate(offer, dp_iteration_s=dp, gpus=gpus, claimed=claimed)
    return (lent, claimed) if lent > alone else (alone, 0)


@dataclass(frozen=True, kw_only=True)
class DemandPolicy:
    """The ``burst+demand`` placement in first-come-first-served order (the module docstring)."""

    hysteresis: Hysteresis = Hysteresis()
    name: str = "burst+demand"

    def decide(self, snapshot: Snapshot) -> Decision:
        turn = _Turns(snapshot)
        turn.admit()
        turn.ahead()
        lend = turn.lend()
        replan, release = turn.retune() if turn.ticking else ((), ())
        starts = turn.starts()
        preempt = (*turn.preempt, *release)
        wake = turn.next_tick()
        if not (preempt or starts or lend or replan):
            return Decision(wake_at_s=wake) if wake is not None else NOTHING
        return Decision(preempt=preempt, start=starts, lend=lend, replan=replan, wake_at_s=wake)


class _Turns:
    """One decision of :class:`DemandPolicy`: the queue's turns, then what runs ahead of them."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot
        self.policy_margin = DEFAULT_MARGIN
        self.hysteresis = Hysteresis()
        self.free = snapshot.free_gpus
        self.preempt: list[int] = []
        self.admitted: list[SimJob] = []  # starting on whole GPUs this decision, in order
        self.started: set[int] = set()
        self.demand: list[SimJob] = []  # background jobs still waiting after this decision's starts
        self.demand_ranks = 0

    def configure(self, hysteresis: Hysteresis) -> _Turns:
        self.hysteresis = hysteresis
        return self

    @property
    def ticking(self) -> bool:
        s = self.snapshot
        return s.round == 0 and bool(s.plans) and s.now_s > 0 and s.now_s % self.hysteresis.tick_s == 0

    def next_tick(self) -> float | None:
        if not self.snapshot.running:
            return None
        tick = self.hysteresis.tick_s
        return (math.floor(self.snapshot.now_s / tick) + 1) * tick

    # ---- the queue's turns ----------------------------------------------
    def _queue(self) -> Iterator[tuple[SimJob, bool]]:
        """Every waiting job and every guest, by arrival: (job, whether it is a guest on lent ranks)."""
        s = self.snapshot
        requeued = s.requeued

        def fresh() -> Iterator[tuple[SimJob, bool]]:
            for job in s.waiting:
                index = bisect.bisect_left(requeued, _arrival(job), key=_arrival)
                if not (index < len(requeued) and requeued[index].job_id == job.job_id):
                    yield job, False

        guests = sorted(s.guests, key=_arrival)
        return heapq.merge(fresh(), ((job, False) for job in requeued), ((job, True) for job in guests),
                           key=lambda pair: _arrival(pair[0]))

    def admit(self) -> None:
        """Start waiting jobs in arrival order while their GPUs are free (taken back from background jobs
        ahead of their turn if need be); move a guest whose turn has come to whole GPUs; stop at the first
        job that cannot start."""
        victims: list[SimJob] | None = None
        for job, guest in self._queue():
            if job.gpus > self.free:
                if victims is None:
                    victims = sorted(self.snapshot.preemptible, key=_arrival, reverse=True)
                if not self._reclaim(job, victims):
                    return
            self.free -= job.gpus
            if guest:
                self.preempt.append(job.job_id)  # its turn: it restarts on whole GPUs next round
            else:
                self.admitted.append(job)
                self.started.add(job.job_id)

    def _reclaim(self, job: SimJob, victims: list[SimJob]) -> bool:
        """Preempt background jobs that arrived after ``job``, newest first, until it fits; False if it cannot."""
        holding, chosen, freed = self.snapshot.holding, [], 0
        for victim in victims:
            if _arrival(victim) <= _arrival(job):
                break
            if victim.job_id not in self.preempt:
                chosen.append(victim.job_id)
                freed += holding[victim.job_id]
                if self.free + freed >= job.gpus:
                    self.preempt += chosen
                    self.free += freed
                    return True
        return False

    # ---- ahead of their turn --------------------------------------------
    def ahead(self) -> None:
        """Background jobs still waiting: on free whole GPUs, in queue order; the rest are the demand for
        lent ranks (counted up to what every running host could lend)."""
        cap = self.snapshot.total_gpus
        for job in self.snapshot.waiting_bg:
            if job.job_id in self.started:
                continue
            if job.gpus <= self.free:
                self.free -= job.gpus
                self.admitted.append(job)
                self.started.add(job.job_id)
                continue
            self.demand.append(job)
            self.demand_ranks += job.gpus
            if self.demand_ranks >= cap:
                return

    def lend(self) -> tuple[Lend, ...]:
        """The demand on lent ranks: hosts that host already first, then hosts whose loans pay for their slowdown."""
        if not self.demand:
            return ()
        s = self.snapshot
        by_host: dict[int, list[Slot]] = {}
        for slot in s.free_slots:
            if slot.host not in self.preempt:
                by_host.setdefault(slot.host, []).append(slot)
        if not by_host:
            return ()
        hosting = [host for host in by_host if host in s.plans and s.plans[host].guests]
        lends = self._fill([slot for host in hosting for slot in by_host[host]])
        for host in sorted(set(by_host) - set(hosting)):
            if not self.demand:
                break
            if self._pays(host, by_host[host]):
                lends += self._fill(by_host[host])
        return tuple(lends)

    def _fill(self, slots: list[Slot]) -> list[Lend]:
        """Lend waiting demand, in order, the smallest-window ranks of ``slots`` that fit each job."""
        slots = sorted(slots, key=lambda slot: (slot.longest_window_ms, slot.host, slot.rank))
        windows = [slot.longest_window_ms for slot in slots]
        lends, left = [], []
        for job in self.demand:
            chosen = _fitting(slots, windows, job) if slots else None
            if chosen is None:
                left.append(job)
            else:
                lends.append(Lend(job_id=job.job_id, slots=chosen))
                self.demand_ranks -= job.gpus
        self.demand = left
        return lends

    def _pays(self, host: int, slots: list[Slot]) -> bool:
        """Whether lending ``slots`` of a host that hosts nothing yet to the demand beats its slowdown."""
        s = self.snapshot
        offers, gpus = s.offers.get(host), s.holding.get(host)
        if offers is None or gpus is None or host not in s.plans:
            return True  # nothing known of its plans: lend, as burst+bg does
        offer = offers[s.plans[host].mode]
        dp = offers[PlanMode.DATA_PARALLEL].iteration_s
        usable = sorted((slot.usable_fraction for slot in slots), reverse=True)[:self.demand_ranks]
        fg_alone = gpus * dp / offer.iteration_s
        fg_hosting = gpus * dp / offer.hosting_iteration_s
        return fg_hosting + sum(usable) > fg_alone * (1 + self.hysteresis.margin)

    # ---- plans ----------------------------------------------------------
    def starts(self) -> tuple[Start, ...]:
        """Every start of this decision, a foreground job on the plan the demand left over makes best."""
        out = []
        for job in self.admitted:
            mode = PlanMode.BURST
            offers = self.snapshot.offers.get(job.job_id) if not job.background else None
            if offers is not None:
                mode, _, lent = best_plan(offers, gpus=job.gpus, demand=self.demand_ranks,
                                          margin=self.hysteresis.margin)
                self.demand_ranks -= lent
            out.append(Start(job_id=job.job_id, gpus=job.gpus, mode=mode))
        return tuple(out)

    def retune(self) -> tuple[tuple[Replan, ...], tuple[int, ...]]:
        """At a tick: re-plans of hosts without guests (the module's rule), and guests sent back from hosts
        whose loans no longer pay for their slowdown."""
        s, h = self.snapshot, self.hysteresis
        replans: list[Replan] = []
        release: list[int] = []
        for host, state in s.plans.items():
            job = s.running_job(host) if hasattr(s, "running_job") else None
            offers = s.offers.get(host)
            gpus = s.holding.get(host)
            if offers is None or gpus is None or host in self.preempt or _is_background(s, host):
                continue
            if state.guests:
                release += self._release(state, offers, gpus)
                continue
            if s.now_s - state.since_s < h.dwell_s:
                continue
            moved = self._replan(host, state, offers, gpus)
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
        current, _ = _best_rate(offers[state.mode], dp=dp, gpus=gpus, demand=self.demand_ranks)
        mode, other, lent = best_plan(offers, gpus=gpus, demand=self.demand_ranks, margin=h.margin, prefer=state.mode)
        if mode is state.mode:
            return None
        horizon = min(h.dwell_s, state.remaining_s)
        if (other - current) * horizon < other * self.snapshot.replan_cost_s:
            return None
        self.demand_ranks -= lent
        return Replan(job_id=host, mode=mode)


def _is_background(snapshot: Snapshot, job_id: int) -> bool:
    offers = snapshot.offers
    return False if offers is None else False


def _fitting(slots: list[Slot], windows: list[float], job: SimJob) -> tuple[Slot, ...] | None:
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
