"""The simulated half of a replay: the live run's jobs in the simulator, with the speeds the live run measured.

**Speed models.** For each (model, batch, slots) of the slice, from the live run's succeeded jobs of it:
``iteration_s``, the median of their measured iteration times, and ``start_up_s``, the median of their
held time less ``steps × their own iteration time`` — what a job costs beyond its steps: the driver's and
the ranks' start, planning, warm-up, the end, and the coordinator noticing each. A job's simulated work is
then ``steps + start_up_s / iteration_s`` iterations of ``iteration_s`` (with ``start_up=False``, its steps
alone: the gap that start-up makes).

**The run.** The same jobs, arriving when the live run submitted them, on a cluster of the coordinator's
slots, under the policy the coordinator runs (:func:`deeppool.scheduling.policies.policy_named`), through
the simulator's own engine (:class:`deeppool.cluster_sim.engine.Simulation`). The slice's jobs are all
foreground jobs, so no plan lends windows here, and nothing is preempted (no restart is charged).

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
from deeppool.replay.live import LiveRecord, LiveRun
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


def simulate(run: LiveRun, speeds: dict[SpeedKey, MeasuredSpeed], policy: str, *,
             start_up: bool = True) -> SimResult:
    """The live run's jobs in the simulator under ``policy``, run by ``speeds`` (the module docstring)."""
    if policy in ADAPTIVE:
        raise DeeppoolError(f"--policy {policy} changes jobs' GPUs and batch while they run: its simulated half "
                            "runs by the coordinator's speed models (deeppool.replay.adaptive)")
    jobs = []
    for index, record in enumerate(sorted(run.records, key=lambda r: (r.submitted_s, r.job_id))):
        speed = speeds[key_of(record.job.model, record.job.gpus)]
        extra = speed.start_up_s / speed.iteration_s if start_up else 0.0
        jobs.append(SimJob(job_id=index, name=record.job.name, arrival_s=record.submitted_s, gpus=record.job.gpus,
                           background=False, model=record.job.model, iterations=record.job.steps + extra,
                           recorded_duration_s=0.0))

    def facts(model: ModelChoice, gpus: int, mode: PlanMode) -> PlanFacts:
        del mode  # the live run measured the plan its coordinator chose: one speed per (model, slots)
        measured = speeds[key_of(model, gpus)]
        return PlanFacts(iteration_s=measured.iteration_s, gpu_seconds_per_iteration=gpus * measured.iteration_s,
                         idle_fractions=(0.0,) * gpus)

    cluster = ClusterSpec(gpus=run.slots, gpus_per_node=run.slots)
    return Simulation(cluster=cluster, jobs=jobs, policy=policy_named(policy), facts=facts,
                      interference=InterferenceModel(), restart_penalty_s=0.0).run()


def compare(run: LiveRun, policy: str, speeds: dict[SpeedKey, MeasuredSpeed]) -> tuple[ReplayComparison, SimResult]:
    """The live run against its simulation (with start-up), and the simulation itself."""
    simulated = simulate(run, speeds, policy)
    steps_only = simulate(run, speeds, policy, start_up=False)
    live = Figures(average_jct_s=statistics.fmean(r.jct_s for r in run.records), makespan_s=run.makespan_s)
    return ReplayComparison(policy=policy, live=live, simulated=_figures(simulated), steps_only=_figures(steps_only)), simulated


def _figures(result: SimResult) -> Figures:
    return Figures(average_jct_s=statistics.fmean(r.jct_s for r in result.records), makespan_s=result.makespan_s)
