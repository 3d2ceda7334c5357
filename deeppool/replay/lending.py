"""The simulated half of a lending replay (``...:burst+bg``): background jobs on whole slots or on the idle ranks
of running foreground jobs, as the live run had them.

**The hosts' windows.** A running foreground job offers the ranks its plan leaves idle. The coordinator's driver
plans each job with the planner at its device model's estimates (``serve --device-model``, ``a100`` by default),
with no network probe (the probe is for plans measured here); the same call here, for the same model file, slots
and batch, gives the same plan, so the simulator's host offers the same ranks. Its idle windows are scaled by
the live iteration time over the plan's predicted one: a rank idle for a share of the predicted iteration is
idle for that share of the measured one.

**A guest's speed.** A lent background job trains in its host's idle windows on the host's ranks (on CPU slots:
``gate`` mode). The simulator runs a guest at ``usable / T₁`` iterations a second, ``T₁`` its own iteration on
one slot (measured live when a job of its model ran on a whole slot, else its calibration's) and ``usable`` the
lent rank's windows times the interference model's efficiency. The efficiency is set from the live run, over
every loan: ``Σ (steps made lent × T₁ + start-up) / Σ lent time × idle share of the host's rank`` (held to
(0, 1]). The steps a loan made are the guest's progress when it ended less that when it began, as the polls saw
them; each loan starts the guest's processes in its host, so it is credited the background jobs' start-up on a
slot, which the simulator counts as work (as it does a job's first start). These are true speeds, as in the
rest of the replay (:mod:`deeppool.replay.compare`).

**Restarts.** The policy preempts background jobs for foreground work and a host's end requeues its guests;
live, each next attempt starts its processes again, resuming from its checkpoint. The simulator charges each
restart the median start-up of the background jobs' model on one slot.

**Not modelled.** The host's slowdown while it hosts is in its measured median iteration time, not a separate
factor (the interference model's ``fg_slowdown`` is 1).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from deeppool.cluster_sim.engine import SimResult
from deeppool.cluster_sim.plans import PlanFacts
from deeppool.errors import DeeppoolError
from deeppool.planner.profiling.interference import InterferenceModel
from deeppool.replay.live import LiveRecord, LiveRun
from deeppool.replay.plot import Band
from deeppool.scheduling import Decision, Policy, Scheduler, Snapshot
from deeppool.scheduling.choice import ModelChoice

DEVICE_MODEL = "a100"
"""``serve --device-model``'s default: what the coordinator plans foreground jobs with."""

PlanShape = Callable[[ModelChoice, int], PlanFacts]
"""(model at its batch, slots) -> the plan's facts as the coordinator's driver plans it."""


@dataclass(frozen=True, kw_only=True)
class LiveLoans:
    """What the live run's loans did: ``loans`` loans to ``guests`` background jobs, at ``efficiency`` (the share
    of lent ranks' idle time that became their progress); ``restart_s``: what a background job's restart costs
    (its start-up on a slot: a requeued guest or preempted background job starts its processes again)."""

    loans: int
    guests: int
    efficiency: float
    restart_s: float

    def model(self) -> InterferenceModel:
        return InterferenceModel(fg_slowdown=1.0, bg_efficiency=self.efficiency)


@dataclass(frozen=True, kw_only=True)
class Loans:
    """A lending replay's simulated half's inputs: the plans, per (model file, batch, slots), of every job of the
    slice as the coordinator's driver plans them, and what the live loans did."""

    lending: LiveLoans
    plans: dict[tuple[str, int, int], PlanFacts]

    def planned(self, model: ModelChoice, gpus: int) -> PlanFacts:
        return self.plans[(str(model.path), model.global_batch, gpus)]


@dataclass(frozen=True)
class LendLog:
    """``policy``, with each decision that starts, lends or preempts kept as (when, decision), for the picture."""

    policy: Policy
    moves: list[tuple[float, Decision]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.policy.name

    def decide(self, snapshot: Snapshot) -> Decision:
        decision = self.policy.decide(snapshot)
        if decision.start or decision.lend or decision.preempt:
            self.moves.append((snapshot.now_s, decision))
        return decision

    def bands(self, result: SimResult) -> list[Band]:
        """Each job's intervals on slots of its own or on a host's lent ranks: a start or a loan opens one, the job's
        next start, loan or preemption, its end, or (lent) its host's end closes it."""
        records = {record.job_id: record for record in result.records}
        opened: dict[int, tuple[float, int, int | None]] = {}  # job -> (from, slots, host)
        bands: list[Band] = []

        def close(job_id: int, at: float) -> None:
            if job_id not in opened:
                return
            start, gpus, host = opened.pop(job_id)
            end = min(at, records[host].finish_s) if host is not None and host in records else at
            if end > start:
                bands.append(Band(job=job_id, name=records[job_id].name, gpus=gpus, start_s=start, end_s=end,
                                  lent=host is not None))

        for at, decision in self.moves:
            for job_id in decision.preempt:
                close(job_id, at)
            for start in decision.start:
                close(start.job_id, at)
                opened[start.job_id] = (at, start.gpus, None)
            for loan in decision.lend:
                close(loan.job_id, at)
                opened[loan.job_id] = (at, len(loan.slots), loan.slots[0].host if loan.slots else None)
        for job_id in list(opened):
            close(job_id, records[job_id].finish_s)
        return bands


def lends(policy: Policy) -> bool:
    """Whether ``policy`` lends running foreground jobs' idle ranks to background jobs."""
    return isinstance(policy, Scheduler) and policy.placement.lends


def planned_facts(model: ModelChoice, gpus: int) -> PlanFacts:
    """The plan the coordinator's driver makes for ``model`` on ``gpus`` slots (the module docstring); on one slot,
    one rank busy all the time (not planned)."""
    if gpus == 1:
        return PlanFacts(iteration_s=1.0, gpu_seconds_per_iteration=1.0, idle_fractions=(0.0,))
    from deeppool.planner.api import plan_model
    from deeppool.planner.request import CostSource, PlanRequest

    plan = plan_model(model.spec, PlanRequest(gpus=gpus, global_batch=model.global_batch),
                      CostSource(device_model=DEVICE_MODEL)).plan
    return PlanFacts.of(plan)


def at_measured_speed(planned: PlanFacts, iteration_s: float, gpus: int) -> PlanFacts:
    """``planned``'s idle shares on a measured iteration of ``iteration_s``: its windows and busy GPU-seconds
    scaled by measured over predicted."""
    if not planned.iteration_s > 0:
        return PlanFacts(iteration_s=iteration_s, gpu_seconds_per_iteration=gpus * iteration_s,
                         idle_fractions=(0.0,) * gpus)
    factor = iteration_s / planned.iteration_s
    windows = tuple(tuple(length * factor for length in rank) for rank in planned.idle_windows_ms)
    return PlanFacts(iteration_s=iteration_s, gpu_seconds_per_iteration=planned.gpu_seconds_per_iteration * factor,
                     idle_fractions=planned.idle_fractions, idle_windows_ms=windows)


def measured_lending(run: LiveRun, one_step_s: Callable[[LiveRecord], float], idle_share: Callable[[int], float],
                     restart_s: float) -> LiveLoans:
    """The loans' efficiency (the module docstring): ``one_step_s(guest)`` its iteration time on a slot of its
    own, ``idle_share(host)`` the idle share of the rank that host lends first, ``restart_s`` the start-up each
    loan pays (the guest's processes start in its host)."""
    made = lent = 0.0
    guests = 0
    for record in run.records:
        intervals = [(end - start, host) for (start, end), host in zip(record.held, record.hosts, strict=False)
                     if host is not None]
        if not intervals:
            continue
        guests += 1
        made += record.lent_steps() * one_step_s(record) + len(intervals) * restart_s
        lent += sum(length * idle_share(host) for length, host in intervals)
    efficiency = min(1.0, made / lent) if lent > 0 else InterferenceModel().bg_efficiency
    if not efficiency > 0:
        raise DeeppoolError("the live run's guests made no progress on their lent ranks: nothing to simulate by")
    return LiveLoans(guests=guests, loans=sum(1 for r in run.records for h in r.hosts if h is not None),
                     efficiency=efficiency, restart_s=restart_s)
