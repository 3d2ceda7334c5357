"""The scheduling policies: pure functions of a :class:`Snapshot`.

A policy is two independent choices:

* the **order** in which waiting jobs get whole GPUs —
  ``fifo`` (strict: the head of the queue blocks it), ``fifo-backfill``
  (arrival order, but a job that fits starts when the head does not), or
  ``tiresias`` (two-dimensional least attained service, Gu et al., NSDI'19,
  as the Pollux artifact's simulator runs it: jobs whose attained service —
  GPUs × time run — is below ``queue_threshold_gpu_s`` (16 GPU-hours) come
  before the others, each queue in arrival order; every decision admits
  jobs greedily in that order, skipping those that do not fit (backfilling),
  and preempts running jobs that fall outside the admitted set);
* the **placement** of each admitted job —
  ``dp`` (data parallel on the GPUs it asked for), ``burst`` (its
  burst-parallel Plan on them; the GPU time the Plan leaves idle is wasted),
  ``burst+bg`` (burst foreground Plans, and background jobs at low priority:
  on free whole GPUs, preempted when foreground work needs them, else on the
  idle ranks running foreground Plans lend, exactly as many as they ask for,
  where a window holds their step pieces and memory holds their rank; a guest
  moves to whole GPUs once enough are free and no background job waits) and
  ``dp+bg`` (the ablation: ``burst+bg`` with data-parallel foreground Plans)
  and ``burst+prio`` (the other ablation: ``burst+bg`` without loans — the
  background's low priority alone, which shows how much of ``burst+bg``'s
  gain is queueing rather than work done in idle windows).

Names: a placement alone is FIFO order (``dp``, ``burst``, ``burst+bg``,
``dp+bg``: their historical meaning; ``burst+prio``); an order alone is data-parallel
placement (``fifo-backfill``, ``tiresias``); ``ORDER:PLACEMENT`` combines
them (``tiresias:burst+bg``).

``pollux`` is the co-adaptive policy of :mod:`deeppool.scheduling.pollux`.

To add a policy, write a class with ``name`` and ``decide`` and list it in
:data:`POLICIES`; the engine needs no change.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Iterable, Iterator
from itertools import chain
from dataclasses import dataclass

from deeppool.scheduling.pollux import PolluxPolicy
from deeppool.scheduling.contract import NOTHING, Decision, Lend, PlanMode, Policy, SimJob, Snapshot, Start
from deeppool.scheduling.demand import DemandPolicy, fitting
from deeppool.errors import DeeppoolError

TIRESIAS_THRESHOLD_GPU_S = 16 * 3600.0
"""Tiresias' queue threshold as the Pollux artifact sets it (``_queue_threshold = 3600 * 16``)."""


class Order(enum.Enum):
    FIFO = "fifo"
    FIFO_BACKFILL = "fifo-backfill"
    TIRESIAS = "tiresias"


class Placement(enum.Enum):
    DP = "dp"
    BURST = "burst"
    DP_BG = "dp+bg"
    BURST_BG = "burst+bg"
    BURST_PRIO = "burst+prio"

    @property
    def mode(self) -> PlanMode:
        if self in (Placement.DP, Placement.DP_BG):
            return PlanMode.DATA_PARALLEL
        return PlanMode.LENDING if self is Placement.BURST_BG else PlanMode.BURST

    @property
    def prioritises(self) -> bool:
        """Whether background jobs wait in their own low-priority queue (and are preempted for foreground work)."""
        return self in (Placement.DP_BG, Placement.BURST_BG, Placement.BURST_PRIO)

    @property
    def lends(self) -> bool:
        return self in (Placement.DP_BG, Placement.BURST_BG)


@dataclass(frozen=True, kw_only=True)
class Scheduler:
    """One order and one placement (see the module docstring)."""

    order: Order
    placement: Placement
    queue_threshold_gpu_s: float = TIRESIAS_THRESHOLD_GPU_S

    @property
    def name(self) -> str:
        if self.order is Order.FIFO:
            return self.placement.value
        if self.placement is Placement.DP:
            return self.order.value
        return f"{self.order.value}:{self.placement.value}"

    def decide(self, snapshot: Snapshot) -> Decision:
        aware = self.placement.prioritises
        if self.order is Order.TIRESIAS:
            preempt, admitted, wake = self._tiresias(snapshot, aware)
        else:
            queue = snapshot.waiting_fg if aware else snapshot.waiting
            reclaimable = snapshot.preemptible_gpus if aware else 0
            preempt, wake = [], None
            admitted = _admit(queue, snapshot.free_gpus + reclaimable, backfill=self.order is Order.FIFO_BACKFILL)
        freed = sum(snapshot.holding[job_id] for job_id in preempt)
        free = snapshot.free_gpus + freed - sum(job.gpus for job in admitted)
        if free < 0:
            free += _reclaim(snapshot, -free, preempt)
        starts = [Start(job_id=job.job_id, gpus=job.gpus, mode=self.placement.mode) for job in admitted]
        lend: list[Lend] = []
        if aware:
            lend, free, drained = _background(snapshot, starts, free, self.placement, set(preempt))
            if drained and not preempt:
                preempt = _promote(snapshot, free)
        if not (preempt or starts or lend):
            return Decision(wake_at_s=wake) if wake is not None else NOTHING
        return Decision(preempt=tuple(preempt), start=tuple(starts), lend=tuple(lend), wake_at_s=wake)

    def _tiresias(self, snapshot: Snapshot, aware: bool) -> tuple[list[int], list[SimJob], float | None]:
        """Admit waiting and running jobs greedily by (queue, arrival); preempt the running ones left out.

        Jobs never run are all in the first queue and wait in arrival order, so only the running and
        requeued jobs are sorted; the rest are merged in lazily until the GPUs are spoken for.
        """
        waiting = snapshot.waiting_fg if aware else snapshot.waiting
        if _within(waiting, snapshot.free_gpus + (snapshot.preemptible_gpus if aware else 0)):
            return [], list(waiting), None  # everyone fits: the greedy pass would admit all
        attained, threshold = snapshot.attained_gpu_s, self.queue_threshold_gpu_s
        running = sorted((job for job in snapshot.running if not (aware and job.background)), key=_arrival)

        def served(first_queue: bool) -> Iterator[SimJob]:
            """Running and requeued jobs of one queue, by arrival (lazily: a decision reads only a prefix)."""
            requeued = (job for job in snapshot.requeued if not (aware and job.background))
            return (job for job in heapq.merge(running, requeued, key=_arrival)
                    if (attained.get(job.job_id, 0.0) < threshold) == first_queue)

        fresh = (job for job in waiting if job.job_id not in attained)
        ranked = chain(heapq.merge(served(True), fresh, key=_arrival), served(False))
        kept = _admit(ranked, snapshot.total_gpus, backfill=True)
        kept_ids = {job.job_id for job in kept}
        preempt = [job.job_id for job in running if job.job_id not in kept_ids]
        admitted = [job for job in kept if job.job_id not in snapshot.holding]
        crossings = [snapshot.now_s + (threshold - attained.get(job.job_id, 0.0)) / job.gpus
                     for job in kept if attained.get(job.job_id, 0.0) < threshold]
        return preempt, admitted, min(crossings, default=None)


def _arrival(job: SimJob) -> tuple[float, int]:
    return job.arrival_s, job.job_id


def _within(jobs: Iterable[SimJob], gpus: int) -> bool:
    """Whether all of ``jobs`` fit in ``gpus`` GPUs (stops at the first excess)."""
    for job in jobs:
        gpus -= job.gpus
        if gpus < 0:
            return False
    return True


def _admit(ordered: Iterable[SimJob], capacity: int, *, backfill: bool) -> list[SimJob]:
    """Jobs in ``ordered`` that fit in ``capacity`` GPUs, in order; without backfill the first misfit stops it."""
    admitted = []
    for job in ordered:
        if capacity <= 0:
            break
        if job.gpus <= capacity:
            admitted.append(job)
            capacity -= job.gpus
        elif not backfill:
            break
    return admitted


def _reclaim(snapshot: Snapshot, shortfall: int, preempt: list[int]) -> int:
    """Preempt background jobs on whole GPUs, newest first, until ``shortfall`` GPUs are free; GPUs freed."""
    freed = 0
    for victim in reversed(snapshot.preemptible):
        if freed >= shortfall:
            break
        if victim.job_id not in preempt:
            preempt.append(victim.job_id)
            freed += snapshot.holding[victim.job_id]
    return freed


def _background(
    snapshot: Snapshot, starts: list[Start], free: int, placement: Placement, leaving: set[int]
) -> tuple[list[Lend], int, bool]:
    """Waiting background jobs on free GPUs, else on lent ranks that fit them; True when none is left waiting.

    Ranks of hosts in ``leaving`` (preempted by this decision) are not lent; none are without ``placement.lends``.
    """
    lends: list[Lend] = []
    lendable = (s for s in snapshot.free_slots if s.host not in leaving) if placement.lends else ()
    slots = sorted(lendable, key=lambda s: (s.longest_window_ms, s.host, s.rank))
    windows = [slot.longest_window_ms for slot in slots]
    for job in snapshot.waiting_bg:
        if job.gpus <= free:
            starts.append(Start(job_id=job.job_id, gpus=job.gpus, mode=placement.mode))
            free -= job.gpus
            continue
        chosen = fitting(slots, windows, job)
        if chosen is None:
            return lends, free, False
        lends.append(Lend(job_id=job.job_id, slots=chosen))
    return lends, free, True


def _promote(snapshot: Snapshot, free: int) -> list[int]:
    """Requeue guests that whole free GPUs could run at full speed (they restart there next round)."""
    promoted = []
    for guest in snapshot.guests:
        if guest.gpus <= free:
            promoted.append(guest.job_id)
            free -= guest.gpus
    return promoted


POLICIES: dict[str, Policy] = {
    policy.name: policy
    for policy in (Scheduler(order=order, placement=placement) for order in Order for placement in Placement)
} | {"burst+demand": DemandPolicy(), "pollux": PolluxPolicy()}
ADAPTIVE = frozenset({"pollux"})
"""Policies that run jobs by their speed models (batch and GPUs chosen together): they need Pollux workloads."""
BASELINE = "dp"


def policy_named(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise DeeppoolError(f"unknown --policy '{name}': use one of {', '.join(POLICIES)}") from None
