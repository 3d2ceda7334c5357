"""Pollux's co-adaptive policy (Qiao et al., OSDI 2021): GPUs and batch sizes chosen together, for goodput.

Every ``interval_s`` (60 s, the artifact's scheduling interval) the policy
reallocates the GPUs over every job that is running or waiting, and picks each
job's global batch for its GPUs. Each job has a speed model
(:class:`~deeppool.scheduling.contract.SpeedModel`): at progress ``p`` it is in
epoch ``e``, and on ``a`` GPUs its best batch gives goodput

    G_j(a) = max_B goodput_j(a, B, e)               (progress per second)

Its *speedup* is measured against its fair share ``f = ⌈GPUs / jobs⌉``,
and a job whose allocation changes is charged the restart it causes, as in the
artifact (``simulator/pollux.py``, ``Problem._evaluate``):

    s_j(a) = G_j(a) / G_j(min(f, a_max)) · (r_j if a ≠ current_j else 1)
    r_j    = max(age_j − restarts_j · delay, 0) / (age_j + delay),   delay = 30 s

and the allocation maximises the power mean with ``p = −1`` (fairness)

    F = ( Σ_j (s_j + ε)^p / n )^(1/p),   ε = 10⁻³,

that is, it minimises ``Σ_j 1 / (s_j + ε)``. A job gets at most twice the most
GPUs it has held (at least 1), as the artifact lets a job explore, and at most
its speed model's ``max_gpus``, and never fewer than its ``min_gpus`` (a job that cannot be resized has
one GPU count, ``min = max``).

The artifact searches allocations with a genetic algorithm (NSGA-II, 100
generations of 100). Here the search is greedy by marginal gain: starting from
no GPUs, repeatedly give the job whose cost ``1 / (s_j + ε)`` falls most per
GPU its next GPU count (1, 2, 3, 4, then whole nodes of 4, or straight back
to its current count), until the GPUs run out or no step lowers the cost. The
objective is a sum of per-job terms, so a marginal-gain greedy is the standard
approximation for it. Because ``ε`` makes an empty allocation cost 1/ε, every
job gets a first GPU before any job gets a second, while GPUs last; ties go to
the job with the least attained service, then the earliest (the artifact's job
order).

Between ticks the policy only asks to be woken at the next one: a new job
waits for it (as in the artifact), and a job's batch stays as chosen.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from deeppool.scheduling.contract import NOTHING, Decision, PlanMode, Rebatch, SimJob, Snapshot, Start

NODE_GPUS = 4
TICK_TOLERANCE_S = 1e-6


@dataclass(frozen=True, kw_only=True)
class _Candidate:
    """One job as the allocation sees it: speedup per GPU count, its current count, its tie-break key."""

    job: SimJob
    epoch: int
    current: int
    speedups: dict[int, float]
    order: tuple[float, float, int]

    def cost(self, gpus: int, epsilon: float) -> float:
        return 1.0 / (self.speedups.get(gpus, 0.0) + epsilon)

    def steps(self, held: int, free: int) -> Iterable[int]:
        """GPU counts this job may move to from ``held``: its next candidate count, and its current one."""
        above = [count for count in self.speedups if count > held]
        if above:
            yield min(above)
        if self.current > held and self.current - held <= free:
            yield self.current


@dataclass(frozen=True, kw_only=True)
class PolluxPolicy:
    """Co-adaptive allocation of GPUs and batch sizes every ``interval_s`` (see the module docstring)."""

    name: str = "pollux"
    interval_s: float = 60.0
    restart_delay_s: float = 30.0
    epsilon: float = 1e-3

    def __post_init__(self) -> None:
        if not (self.interval_s > 0 and self.restart_delay_s >= 0 and self.epsilon > 0):
            raise ValueError(f"pollux policy: interval {self.interval_s} s must be > 0, restart delay "
                             f"{self.restart_delay_s} s >= 0, epsilon {self.epsilon} > 0")

    def decide(self, snapshot: Snapshot) -> Decision:
        jobs = [job for job in (*snapshot.running, *snapshot.waiting) if job.speed is not None]
        if not jobs:
            return NOTHING
        ticks = snapshot.now_s / self.interval_s
        wake = (math.floor(ticks + TICK_TOLERANCE_S) + 1) * self.interval_s
        if snapshot.round > 0 or abs(ticks - round(ticks)) * self.interval_s > TICK_TOLERANCE_S:
            return Decision(wake_at_s=wake)
        candidates = [self._candidate(snapshot, job, len(jobs)) for job in jobs]
        allocation = self._allocate(candidates, snapshot.total_gpus)
        return self._changes(snapshot, candidates, allocation, wake)

    def _candidate(self, snapshot: Snapshot, job: SimJob, count: int) -> _Candidate:
        speed = job.speed
        assert speed is not None
        state = snapshot.adaptive.get(job.job_id)
        progress, restarts, peak = (state.progress, state.restarts, state.peak_gpus) if state else (0.0, 0, 0)
        epoch = speed.epoch_at(max(progress, 0.0))
        current = snapshot.holding.get(job.job_id, 0)
        floor = speed.min_gpus
        cap = max(min(speed.max_gpus, max(2 * peak, 1), snapshot.total_gpus), floor)
        fair = max(min(math.ceil(snapshot.total_gpus / count), speed.max_gpus), floor)
        base = speed.best_batch(fair, epoch)[1] or 1.0
        age = snapshot.now_s - job.arrival_s
        spent = age + self.restart_delay_s
        factor = max(age - restarts * self.restart_delay_s, 0.0) / spent if spent > 0 else 1.0
        speedups = {}
        for gpus in _counts(cap, current, floor):
            value = speed.best_batch(gpus, epoch)[1] / base
            speedups[gpus] = value if gpus == current else value * factor
        attained = snapshot.attained_gpu_s.get(job.job_id, 0.0)
        return _Candidate(job=job, epoch=epoch, current=current, speedups=speedups,
                          order=(attained, job.arrival_s, job.job_id))

    def _allocate(self, candidates: list[_Candidate], gpus: int) -> dict[int, int]:
        """Greedy by marginal gain of ``Σ 1/(s + ε)`` per GPU (ties: least attained service, then earliest)."""
        held = {c.job.job_id: 0 for c in candidates}
        free = gpus
        while free > 0:
            steps = [(self._gain(c, held[c.job.job_id], target), c.order, c, target)
                     for c in candidates for target in c.steps(held[c.job.job_id], free)
                     if target - held[c.job.job_id] <= free]
            useful = [step for step in steps if step[0] > 1e-12]
            if not useful:
                break
            _, _, chosen, target = min(useful, key=lambda step: (-step[0], step[1]))
            free -= target - held[chosen.job.job_id]
            held[chosen.job.job_id] = target
        return held

    def _gain(self, candidate: _Candidate, held: int, target: int) -> float:
        """How much ``Σ 1/(s + ε)`` falls per GPU when ``candidate`` goes from ``held`` to ``target`` GPUs."""
        return (candidate.cost(held, self.epsilon) - candidate.cost(target, self.epsilon)) / (target - held)

    def _changes(self, snapshot: Snapshot, candidates: list[_Candidate], allocation: dict[int, int],
                 wake: float) -> Decision:
        """Preempt jobs whose GPU count changes, start them (and new jobs) anew, retune the batch of the rest."""
        preempt, start, rebatch = [], [], []
        for candidate in candidates:
            job, gpus = candidate.job, allocation[candidate.job.job_id]
            assert job.speed is not None
            batch = job.speed.best_batch(gpus, candidate.epoch)[0] if gpus else 0
            if gpus != candidate.current:
                if candidate.current:
                    preempt.append(job.job_id)
                if gpus:
                    start.append(Start(job_id=job.job_id, gpus=gpus, mode=PlanMode.DATA_PARALLEL, batch=batch))
            elif gpus:
                state = snapshot.adaptive.get(job.job_id)
                if state is not None and state.batch != batch:
                    rebatch.append(Rebatch(job_id=job.job_id, batch=batch))
        return Decision(preempt=tuple(preempt), start=tuple(start), rebatch=tuple(rebatch), wake_at_s=wake)


def _counts(cap: int, current: int, floor: int = 1) -> list[int]:
    """GPU counts a job may get: ``floor`` (its fewest), up to a node, then whole nodes, up to ``cap``; and its
    current count."""
    counts = {g for g in range(1, min(cap, NODE_GPUS) + 1)} | set(range(2 * NODE_GPUS, cap + 1, NODE_GPUS))
    counts = {g for g in counts if g >= floor} | {floor}
    if 0 < current <= cap:
        counts.add(current)
    return sorted(counts)
