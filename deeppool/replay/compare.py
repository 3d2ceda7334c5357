"""The simulated half of a replay: the live run's jobs in the simulator, with the speeds the live run measured.

**Speed models.** For each (model, batch, slots) of the slice, from the live run's succeeded jobs of it:
``iteration_s``, the median of their measured iteration times, and ``start_up_s``, the median of their
held time less ``steps × their own iteration time`` — what a job costs beyond its steps: the driver's and
the ranks' start, planning, warm-up, the end, and the coordinator noticing each. A job's simulated work is
then ``steps + start_up_s / iteration_s`` iterations of ``iteration_s`` (with ``start_up=False``, its steps
alone: the gap that start-up makes).

**The run.** The same jobs, arriving when the live run submitted them, on a cluster of the coordinator's
slots, under the policy the coordinator runs (:func:`deeppool.scheduling.policies.policy_named`), through
the simulator's own engine (:class:`deeppool.cluster_sim.engine.Simulation`). Under a policy that does not
lend, the slice's jobs are all foreground jobs, no plan lends windows and nothing is preempted (no restart is
charged). Under a lending policy (``...:burst+bg``) the slice's background jobs are lent the idle ranks of the
hosts' plans, and a background job's restart is charged (:mod:`deeppool.replay.lending`); a job that ran on lent
ranks is left out of the speeds per (model, batch, slots), and one never measured on a slot of its own runs by
its calibration's iteration time and the median one-slot start-up.

**The comparison.** Average JCT (finish less submission) and makespan (the last finish, from the first
submission), live and simulated, and the simulated over the live less one.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from deeppool.cluster_sim.cluster import ClusterSpec
from deeppool.cluster_sim.engine import SimResult, Simulation
from deeppool.cluster_sim.plans import PlanFacts, PlanMode
from deeppool.errors import DeeppoolError
from deeppool.planner.profiling.interference import InterferenceModel
from deeppool.replay.lending import LendLog, Loans, PlanShape, at_measured_speed, measured_lending, planned_facts
from deeppool.replay.live import LiveRecord, LiveRun
from deeppool.replay.plot import Band, simulated_bands
from deeppool.scheduling.choice import ModelChoice
from deeppool.scheduling.contract import SimJob
from deeppool.scheduling.policies import ADAPTIVE, policy_named

SpeedKey = tuple[str, int, int]
"""(model file, global batch, slots)"""


@dataclass(frozen=True, kw_only=True)
class MeasuredSpeed:
    """A (model, batch, slots)'s speed in the live run: median iteration and start-up over its ``jobs``."""

    model: str
    batch: int
    gpus: int
    iteration_s: float
    start_up_s: float
    jobs: int


@dataclass(frozen=True, kw_only=True)
class Figures:
    average_jct_s: float
    makespan_s: float


@dataclass(frozen=True, kw_only=True)
class ReplayComparison:
    policy: str
    live: Figures
    simulated: Figures
    steps_only: Figures
    """the simulation without start-up (each job's steps alone)"""

    @staticmethod
    def gap(simulated: float, live: float) -> float:
        return simulated / live - 1.0

    @property
    def jct_gap(self) -> float:
        return self.gap(self.simulated.average_jct_s, self.live.average_jct_s)

    @property
    def makespan_gap(self) -> float:
        return self.gap(self.simulated.makespan_s, self.live.makespan_s)


def key_of(model: ModelChoice, gpus: int) -> SpeedKey:
    return str(model.path), model.global_batch, gpus


def measured_speeds(run: LiveRun) -> dict[SpeedKey, MeasuredSpeed]:
    """Each (model, batch, slots)'s speed model from the live run (the module docstring)."""
    failed = run.failed()
    if failed:
        shown = "; ".join(f"{r.job.name} (job {r.job_id}) {r.state.value}: {r.reason or 'no iteration time'}"
                          for r in failed[:3])
        raise DeeppoolError(f"{len(failed)} job(s) of the live run did not succeed with a measured iteration time, "
                            f"so their speed is unknown: {shown}")
    grouped: dict[SpeedKey, list[LiveRecord]] = defaultdict(list)
    for record in run.records:
        if record.lent_s == 0:  # a guest's time on lent ranks is its loan's speed (deeppool.replay.lending)
            grouped[key_of(record.job.model, record.job.gpus)].append(record)
    speeds = {}
    for key, records in grouped.items():
        iterations = [r.iteration_s for r in records if r.iteration_s is not None]
        start_ups = [max(0.0, _held_s(r) - r.job.steps * (r.iteration_s or 0.0)) for r in records]
        speeds[key] = MeasuredSpeed(model=records[0].job.model.name, batch=key[1], gpus=key[2],
                                    iteration_s=statistics.median(iterations),
                                    start_up_s=statistics.median(start_ups), jobs=len(records))
    return speeds


def _held_s(record: LiveRecord) -> float:
    return sum(end - start for start, end in record.held)


def speed_of(record: LiveRecord, speeds: dict[SpeedKey, MeasuredSpeed]) -> MeasuredSpeed:
    """The speed ``record``'s job runs by on its slots: measured, or, for a background job that ran only on lent
    ranks, its calibration's iteration time and the median start-up of the jobs measured on one slot."""
    key = key_of(record.job.model, record.job.gpus)
    if key in speeds:
        return speeds[key]
    one = [speed.start_up_s for speed in speeds.values() if speed.gpus == 1] or [s.start_up_s for s in speeds.values()]
    return MeasuredSpeed(model=record.job.model.name, batch=key[1], gpus=key[2], iteration_s=record.job.step_s,
                         start_up_s=statistics.median(one) if one else 0.0, jobs=0)


def simulate(run: LiveRun, speeds: dict[SpeedKey, MeasuredSpeed], policy: str, *, start_up: bool = True,
             lending: Loans | None = None) -> tuple[SimResult, list[Band]]:
    """The live run's jobs in the simulator under ``policy``, run by ``speeds`` (the module docstring), and each
    job's intervals on slots or lent ranks; under a lending policy, ``lending`` gives the hosts' plans and the
    guests' speed (:mod:`deeppool.replay.lending`)."""
    if policy in ADAPTIVE:
        raise DeeppoolError(f"--policy {policy} changes jobs' GPUs and batch while they run: its simulated half "
                            "runs by the coordinator's speed models (deeppool.replay.adaptive)")
    jobs = []
    by_key: dict[SpeedKey, MeasuredSpeed] = dict(speeds)
    for index, record in enumerate(sorted(run.records, key=lambda r: (r.submitted_s, r.job_id))):
        speed = by_key.setdefault(key_of(record.job.model, record.job.gpus), speed_of(record, speeds))
        extra = speed.start_up_s / speed.iteration_s if start_up else 0.0
        jobs.append(SimJob(job_id=index, name=record.job.name, arrival_s=record.submitted_s, gpus=record.job.gpus,
                           background=record.job.background, model=record.job.model,
                           iterations=record.job.steps + extra, recorded_duration_s=0.0))

    def facts(model: ModelChoice, gpus: int, mode: PlanMode) -> PlanFacts:
        del mode  # the live run measured the plan its coordinator chose: one speed per (model, slots)
        measured = by_key[key_of(model, gpus)]
        if lending is not None:
            return at_measured_speed(lending.planned(model, gpus), measured.iteration_s, gpus)
        return PlanFacts(iteration_s=measured.iteration_s, gpu_seconds_per_iteration=gpus * measured.iteration_s,
                         idle_fractions=(0.0,) * gpus)

    cluster = ClusterSpec(gpus=run.slots, gpus_per_node=run.slots)
    interference = lending.lending.model() if lending is not None else InterferenceModel()
    logged = LendLog(policy_named(policy))
    result = Simulation(cluster=cluster, jobs=jobs, policy=logged, facts=facts, interference=interference,
                        restart_penalty_s=lending.lending.restart_s if lending is not None else 0.0).run()
    return result, logged.bands(result) if lending is not None else simulated_bands(result)


def compare(run: LiveRun, policy: str, speeds: dict[SpeedKey, MeasuredSpeed], *,
            lending: Loans | None = None) -> tuple[ReplayComparison, SimResult, list[Band]]:
    """The live run against its simulation (with start-up), the simulation itself and its jobs' intervals."""
    simulated, bands = simulate(run, speeds, policy, lending=lending)
    steps_only, _ = simulate(run, speeds, policy, start_up=False, lending=lending)
    live = Figures(average_jct_s=statistics.fmean(r.jct_s for r in run.records), makespan_s=run.makespan_s)
    comparison = ReplayComparison(policy=policy, live=live, simulated=_figures(simulated),
                                  steps_only=_figures(steps_only))
    return comparison, simulated, bands


def _figures(result: SimResult) -> Figures:
    return Figures(average_jct_s=statistics.fmean(r.jct_s for r in result.records), makespan_s=result.makespan_s)


def measured_loans(run: LiveRun, speeds: dict[SpeedKey, MeasuredSpeed], *,
                   plan: PlanShape = planned_facts) -> Loans:
    """The plans of the slice's jobs (``plan``: as the coordinator's driver makes them) and what the live loans
    did (:mod:`deeppool.replay.lending`)."""
    plans = {key_of(r.job.model, r.job.gpus): plan(r.job.model, r.job.gpus) for r in run.records}
    hosts = {r.job_id: r for r in run.records}

    def idle_share(host_id: int) -> float:
        host = hosts.get(host_id)
        return max(plans[key_of(host.job.model, host.job.gpus)].idle_fractions, default=0.0) if host else 0.0

    background = [speed_of(r, speeds).start_up_s for r in run.records if r.job.background]
    restart_s = statistics.median(background) if background else 0.0
    lending = measured_lending(run, lambda guest: speed_of(guest, speeds).iteration_s, idle_share, restart_s)
    return Loans(lending=lending, plans=plans)
