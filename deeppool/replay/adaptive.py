"""The simulated half of a co-adaptive replay (``pollux``): each job run by the speed model the coordinator fitted.

**Speed models.** Each job's model is the coordinator's own (:func:`deeppool.coordinator.speeds.speed_model`)
over the speed points it measured of the job (``GET /v1/jobs/{id}/speed``: a median iteration time and the
last noise scale per (slots, batch) the job ran on); a job that ended before a point was measured takes its
model file's points from the other jobs. Progress is counted in steps at the asked batch.

**Start-up.** Per model file, the median over its jobs of ``(held time − Σ steps × iteration time over its
points) / attempts`` (attempts: one, plus each resize that restarted it): what an attempt costs beyond its
measured steps (processes, planning, warm-up, the end, the coordinator noticing). A job's first start adds it
as ``start_up_s / T(1, asked batch)`` steps of work: Pollux starts every job on one slot (at most twice the
GPUs it has held, at least one) at its asked batch (no noise scale is measured before it runs); a restart costs the engine's restart penalty,
the median cost of the run's finished resizes (checkpoint, stop, plan and restart; 0 when none finished).

**The run.** The same jobs, arriving when the live run submitted them, under the policy object ``serve
--policy`` runs (:func:`deeppool.coordinator.live_policy.live_policy`), through the simulator's engine. The
live policy ticks on wall-clock multiples of its interval (60 s, or ``serve --policy-interval``, which the
replay is given as ``--policy-interval``); the simulation shifts the slice by the first
submission's offset into an interval, so its ticks fall at the same moments of the slice. The slots each job
held over time are recorded from the policy's decisions (a start opens a band, a preemption or the job's
end closes it).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from deeppool.cluster_sim.cluster import ClusterSpec
from deeppool.cluster_sim.engine import SimResult, Simulation
from deeppool.cluster_sim.plans import PlanFacts, PlanMode
from deeppool.coordinator.jobs import Job, JobKind, JobStatus, SpeedPoint
from deeppool.coordinator.live_policy import live_policy
from deeppool.coordinator.speeds import LiveSpeed, speed_model
from deeppool.errors import DeeppoolError
from deeppool.planner.profiling.interference import InterferenceModel
from deeppool.replay.compare import Figures, ReplayComparison
from deeppool.replay.live import LiveRecord, LiveRun
from deeppool.replay.plot import Band
from deeppool.scheduling.choice import ModelChoice
from deeppool.scheduling.contract import Decision, Policy, SimJob, Snapshot

RESTARTED = ("DONE", "REVERTED")
"""Resize phases after which the job ran a new attempt."""


@dataclass(frozen=True, kw_only=True)
class FittedSpeed:
    """A model file's speed in the live run, as the coordinator fitted it: ``T(g, M) = α + β · M / g`` over
    the points of all its jobs, the last noise scale measured, and its start-up per attempt."""

    model: str
    jobs: int
    points: tuple[tuple[int, int, float], ...]
    """(slots, batch, iteration s) measured"""
    alpha_s: float
    beta_s: float
    noise_scale: float | None
    start_up_s: float


@dataclass(frozen=True, kw_only=True)
class AdaptiveReplay:
    comparison: ReplayComparison
    simulated: SimResult
    bands: tuple[Band, ...]
    """the simulated run's slots over time"""
    fits: tuple[FittedSpeed, ...]
    restart_s: float


@dataclass(frozen=True)
class _DecisionLog:
    """``policy``, with each decision that changed something kept as (when, decision)."""

    name: str
    policy: Policy
    moves: list[tuple[float, Decision]] = field(default_factory=list)

    def decide(self, snapshot: Snapshot) -> Decision:
        decision = self.policy.decide(snapshot)
        if not decision.empty:
            self.moves.append((snapshot.now_s, decision))
        return decision


def replay_adaptive(run: LiveRun, policy: str, *, interval_s: float | None = None) -> AdaptiveReplay:
    """The live run against its simulation under co-adaptive ``policy`` (the module docstring), ticking every
    ``interval_s`` as the coordinator did (``serve --policy-interval``; None: the policy's own)."""
    unmeasured = [r for r in run.records if r.speed is None]
    if unmeasured:
        raise DeeppoolError(f"job {unmeasured[0].job_id} of the live run has no speed record from the coordinator")
    pooled = _pooled(run.records)
    start_ups = _start_ups(run.records)
    restart_s = _restart_s(run.records)
    chosen = live_policy(policy, interval_s=interval_s).policy
    simulated, bands = _simulate(run, chosen, pooled, start_ups, restart_s, start_up=True)
    steps_only, _ = _simulate(run, chosen, pooled, start_ups, restart_s, start_up=False)
    live = Figures(average_jct_s=statistics.fmean(r.jct_s for r in run.records), makespan_s=run.makespan_s)
    comparison = ReplayComparison(policy=policy, live=live, simulated=_figures(simulated),
                                  steps_only=_figures(steps_only))
    return AdaptiveReplay(comparison=comparison, simulated=simulated, bands=tuple(bands),
                          fits=_fits(run.records, pooled, start_ups), restart_s=restart_s)


def _points(record: LiveRecord) -> list[SpeedPoint]:
    return list(record.speed.points) if record.speed is not None else []


def _pooled(records: Sequence[LiveRecord]) -> dict[str, list[SpeedPoint]]:
    pooled: dict[str, list[SpeedPoint]] = defaultdict(list)
    for record in records:
        pooled[str(record.job.model.path)] += _points(record)
    return pooled


def _attempts(record: LiveRecord) -> int:
    resizes = record.speed.resizes if record.speed is not None else []
    return 1 + sum(1 for change in resizes if change.phase in RESTARTED and change.to_gpus > 0)


def _start_ups(records: Sequence[LiveRecord]) -> dict[str, float]:
    """Per model file, the median start-up per attempt over its jobs (the module docstring)."""
    found: dict[str, list[float]] = defaultdict(list)
    for record in records:
        held = sum(end - start for start, end in record.held)
        work = sum(p.steps * p.iteration_s for p in _points(record))
        found[str(record.job.model.path)].append(max(0.0, held - work) / _attempts(record))
    return {model: statistics.median(values) for model, values in found.items()}


def _restart_s(records: Sequence[LiveRecord]) -> float:
    costs = [sum(part or 0.0 for part in (c.checkpoint_s, c.stop_s, c.plan_s, c.restart_s))
             for r in records for c in (r.speed.resizes if r.speed is not None else []) if c.phase == "DONE"
             and c.to_gpus > 0]
    return statistics.median(costs) if costs else 0.0


def _model(record: LiveRecord, pooled: dict[str, list[SpeedPoint]], slots: int) -> LiveSpeed:
    speed = record.speed
    assert speed is not None
    job = speed_job(record)
    points = speed.points or pooled[str(record.job.model.path)]
    return speed_model(job, points, total_gpus=slots, rigid=False)


def speed_job(record: LiveRecord) -> Job:
    """The job as it was asked for (slots, batch, steps): what its speed model counts progress against."""
    at = datetime.fromtimestamp(0, UTC)
    return Job(id=record.job_id, kind=JobKind.FOREGROUND, state=JobStatus.PENDING, owner="replay",
               model=str(record.job.model.path), gpus=record.job.gpus, batch=record.job.batch,
               steps=record.job.steps, amplification=None, created_at=at, updated_at=at)


def _simulate(run: LiveRun, chosen: Policy, pooled: dict[str, list[SpeedPoint]], start_ups: dict[str, float],
              restart_s: float, *, start_up: bool) -> tuple[SimResult, list[Band]]:
    interval = float(getattr(chosen, "interval_s", 0.0))
    offset = run.began_at % interval if interval > 0 else 0.0
    jobs = []
    order = sorted(run.records, key=lambda r: (r.submitted_s, r.job_id))
    for index, record in enumerate(order):
        model = _model(record, pooled, run.slots)
        extra = (start_ups[str(record.job.model.path)] / model.fit.iteration_s(1, record.job.batch)
                 if start_up else 0.0)
        jobs.append(SimJob(job_id=index, name=record.job.name, arrival_s=record.submitted_s + offset,
                           gpus=record.job.gpus, background=False, model=record.job.model,
                           iterations=float(record.job.steps), recorded_duration_s=0.0,
                           speed=replace(model, steps=record.job.steps + round(extra))))
    fits = {str(r.job.model.path): _model(r, pooled, run.slots).fit for r in order}

    def facts(model: ModelChoice, gpus: int, mode: PlanMode) -> PlanFacts:
        del mode  # a co-adaptive policy starts every job with a batch: by its speed model, not a plan
        seconds = fits[str(model.path)].iteration_s(gpus, model.global_batch)
        return PlanFacts(iteration_s=seconds, gpu_seconds_per_iteration=gpus * seconds, idle_fractions=(0.0,) * gpus)

    recording = _DecisionLog(name=chosen.name, policy=chosen)
    cluster = ClusterSpec(gpus=run.slots, gpus_per_node=run.slots)
    result = Simulation(cluster=cluster, jobs=jobs, policy=recording, facts=facts, interference=InterferenceModel(),
                        restart_penalty_s=restart_s).run()
    return result, _bands(recording.moves, result, offset)


def _bands(moves: Sequence[tuple[float, Decision]], result: SimResult, offset: float) -> list[Band]:
    """Each job's slots over time from the policy's decisions and the jobs' ends, shifted back by ``offset``."""
    names = {record.job_id: record.name for record in result.records}
    open_: dict[int, tuple[float, int]] = {}
    bands: list[Band] = []

    def close(job_id: int, at: float) -> None:
        if job_id in open_:
            start, gpus = open_.pop(job_id)
            if at > start:
                bands.append(Band(job=job_id, name=names.get(job_id, str(job_id)), gpus=gpus,
                                  start_s=start - offset, end_s=at - offset))

    for at, decision in moves:
        for job_id in decision.preempt:
            close(job_id, at)
        for start in decision.start:
            close(start.job_id, at)
            open_[start.job_id] = (at, start.gpus)
    for record in result.records:
        close(record.job_id, record.finish_s)
    return bands


def _figures(result: SimResult) -> Figures:
    """Average JCT and makespan (from the first arrival: the slice is shifted by the tick offset)."""
    ends = [record.finish_s for record in result.records]
    first = min(record.arrival_s for record in result.records)
    return Figures(average_jct_s=statistics.fmean(r.jct_s for r in result.records), makespan_s=max(ends) - first)


def _fits(records: Sequence[LiveRecord], pooled: dict[str, list[SpeedPoint]],
          start_ups: dict[str, float]) -> tuple[FittedSpeed, ...]:
    fits = []
    for model, points in sorted(pooled.items()):
        mine = [r for r in records if str(r.job.model.path) == model]
        fitted = speed_model(speed_job(mine[0]), points, total_gpus=1, rigid=False) if points else None
        fits.append(FittedSpeed(model=mine[0].job.model.name, jobs=len(mine),
                                points=tuple((p.gpus, p.batch, p.iteration_s) for p in points),
                                alpha_s=fitted.fit.alpha if fitted else 0.0, beta_s=fitted.fit.beta if fitted else 0.0,
                                noise_scale=fitted.noise_scale if fitted else None, start_up_s=start_ups[model]))
    return tuple(fits)
