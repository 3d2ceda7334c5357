"""The scheduling policies: pure functions of a :class:`Snapshot`.

* ``dp``       — every job data parallel on the GPUs it asked for, strict FIFO.
* ``burst``    — every job runs its burst-parallel Plan on the GPUs it asked
  for, strict FIFO; GPU time the plan leaves idle is wasted.
* ``burst+bg`` — foreground jobs as in ``burst``; background jobs (a workload
  property) have low priority: they take free whole GPUs when there are any
  (and are preempted when a foreground job needs them), else they run on the
  idle ranks that running foreground Plans lend, at the interference model's
  rate; a job on lent ranks moves to whole GPUs as soon as enough are free
  and no background job waits.
* ``dp+bg``    — the ablation: ``burst+bg`` with data-parallel foreground plans,
  whose ranks are rarely idle.

To add a policy, write a class with ``name`` and ``decide`` and list it in
:data:`POLICIES`; the engine needs no change.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice

from deeppool.cluster_sim.policy import NOTHING, Decision, Lend, PlanMode, Policy, Snapshot, Start
from deeppool.errors import DeeppoolError


@dataclass(frozen=True, kw_only=True)
class Fifo:
    """All jobs, background or not, in arrival order; the head blocks the queue."""

    name: str
    mode: PlanMode

    def decide(self, snapshot: Snapshot) -> Decision:
        free = snapshot.free_gpus
        starts = []
        for job in snapshot.waiting:
            if job.gpus > free:
                break
            starts.append(Start(job_id=job.job_id, gpus=job.gpus, mode=self.mode))
            free -= job.gpus
        return Decision(start=tuple(starts)) if starts else NOTHING


@dataclass(frozen=True, kw_only=True)
class FifoWithBackground:
    """Foreground FIFO on whole GPUs; background jobs on free GPUs, else on lent idle ranks."""

    name: str
    mode: PlanMode

    def decide(self, snapshot: Snapshot) -> Decision:
        preempt, starts, free = self._foreground(snapshot)
        lends, free, drained = self._background(snapshot, starts, free)
        if drained and not preempt:
            preempt = self._promote(snapshot, free)
        if not (preempt or starts or lends):
            return NOTHING
        return Decision(preempt=tuple(preempt), start=tuple(starts), lend=tuple(lends))

    @staticmethod
    def _promote(snapshot: Snapshot, free: int) -> list[int]:
        """Requeue guests that whole free GPUs could run at full speed (they restart there next round)."""
        promoted = []
        for guest in snapshot.guests:
            if guest.gpus <= free:
                promoted.append(guest.job_id)
                free -= guest.gpus
        return promoted

    def _foreground(self, snapshot: Snapshot) -> tuple[list[int], list[Start], int]:
        free, reclaimable = snapshot.free_gpus, snapshot.preemptible_gpus
        victims = reversed(snapshot.preemptible)
        preempt: list[int] = []
        starts: list[Start] = []
        for job in snapshot.waiting_fg:
            if job.gpus > free + reclaimable:
                break
            while job.gpus > free:
                victim = next(victims)
                preempt.append(victim.job_id)
                free += victim.gpus
                reclaimable -= victim.gpus
            starts.append(Start(job_id=job.job_id, gpus=job.gpus, mode=self.mode))
            free -= job.gpus
        return preempt, starts, free

    def _background(self, snapshot: Snapshot, starts: list[Start], free: int) -> tuple[list[Lend], int, bool]:
        """Waiting background jobs on free GPUs, else on lent ranks; True when none is left waiting."""
        lends: list[Lend] = []
        slots = iter(snapshot.free_slots)
        slots_left = len(snapshot.free_slots)
        for job in snapshot.waiting_bg:
            if job.gpus <= free:
                starts.append(Start(job_id=job.job_id, gpus=job.gpus, mode=self.mode))
                free -= job.gpus
            elif job.gpus <= slots_left:
                lends.append(Lend(job_id=job.job_id, slots=tuple(islice(slots, job.gpus))))
                slots_left -= job.gpus
            else:
                return lends, free, False
        return lends, free, True


POLICIES: dict[str, Policy] = {
    policy.name: policy
    for policy in (
        Fifo(name="dp", mode=PlanMode.DATA_PARALLEL),
        Fifo(name="burst", mode=PlanMode.BURST),
        FifoWithBackground(name="burst+bg", mode=PlanMode.BURST),
        FifoWithBackground(name="dp+bg", mode=PlanMode.DATA_PARALLEL),
    )
}
BASELINE = "dp"


def policy_named(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise DeeppoolError(f"unknown --policy '{name}': use one of {', '.join(POLICIES)}") from None
