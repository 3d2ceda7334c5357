"""From a workload to simulated jobs, and from jobs to one result per policy."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from deeppool.cluster_sim.cluster import ClusterSpec
from deeppool.cluster_sim.engine import SimResult, Simulation
from deeppool.cluster_sim.models import ModelMapping
from deeppool.cluster_sim.plans import PlanBook, PlanMode
from deeppool.cluster_sim.workload import BackgroundRule, TraceJob, Workload
from deeppool.errors import DeeppoolError
from deeppool.planner.profiling.interference import InterferenceModel
from deeppool.scheduling.choice import ModelChoice
from deeppool.scheduling.contract import SimJob, SpeedModel
from deeppool.scheduling.policies import policy_named

DEFAULT_RESTART_PENALTY_S = 30.0
"""Time lost each time a preempted or evicted job runs again: the Pollux artifact simulator's restart delay."""


@dataclass(frozen=True, kw_only=True)
class Assignment:
    """Workload jobs with their models, before their work is known."""

    jobs: tuple[TraceJob, ...]
    models: tuple[ModelChoice, ...]
    background: tuple[bool, ...]
    dropped: int

    def needs(self) -> list[tuple[ModelChoice, int]]:
        """Every distinct (model, GPU count), largest first (the slow solves show early)."""
        pairs = dict.fromkeys(zip(self.models, (job.gpus for job in self.jobs), strict=True))
        return sorted(pairs, key=lambda pair: (-pair[1], pair[0].name))


def assign(
    workload: Workload,
    *,
    mapping: ModelMapping,
    rule: BackgroundRule,
    cluster: ClusterSpec,
    seed: int,
    drop_oversized: bool,
) -> Assignment:
    """Map every job to a model (seeded), classify it, and check that it fits the cluster."""
    rng = random.Random(seed)
    kept, models, background = [], [], []
    interned: dict[tuple[str, int], ModelChoice] = {}
    dropped = 0
    for job in workload.jobs:
        if job.gpus > cluster.gpus:
            if drop_oversized:
                dropped += 1
                continue
            raise DeeppoolError(
                f"{job.where}: job '{job.name}' asks for {job.gpus} GPUs but the cluster has {cluster.gpus}: "
                "raise --gpus or pass --drop-oversized"
            )
        models.append(_job_model(mapping.resolve(job.key, rng, where=job.where), job, interned))
        background.append(rule.is_background(job))
        kept.append(job)
    if not kept:
        raise DeeppoolError(f"every job of {workload.source} asks for more than the cluster's {cluster.gpus} GPUs")
    return Assignment(jobs=tuple(kept), models=tuple(models), background=tuple(background), dropped=dropped)


def _job_model(model: ModelChoice, job: TraceJob, interned: dict[tuple[str, int], ModelChoice]) -> ModelChoice:
    """``model`` at the job's batch (the batch rule of :mod:`models`), one shared object per (model, batch)."""
    batch = model.batch_for(job.gpus, job.batch_size)
    if batch < job.gpus:
        raise DeeppoolError(f"{job.where}: job '{job.name}' trains at batch {batch} on {job.gpus} GPUs: some GPUs "
                            "would hold no sample; give a per_gpu_batch in the --mapping file")
    key = (str(model.path), batch)
    if key not in interned:
        interned[key] = replace(model, global_batch=batch)
    return interned[key]


def sim_jobs(assignment: Assignment, book: PlanBook,
             speeds: Callable[[TraceJob], SpeedModel] | None = None) -> tuple[SimJob, ...]:
    """Each job's work: its recorded duration over its recorded allocation's data-parallel iteration time.

    With ``speeds`` each job also gets its speed model, which co-adaptive policies run it by.
    """
    jobs = []
    for index, (job, model, background) in enumerate(
        zip(assignment.jobs, assignment.models, assignment.background, strict=True)
    ):
        dp = book.facts(model, job.gpus, PlanMode.DATA_PARALLEL)
        jobs.append(
            SimJob(
                job_id=index,
                name=job.name,
                arrival_s=job.arrival_s,
                gpus=job.gpus,
                background=background,
                model=model,
                iterations=job.duration_s / dp.iteration_s,
                recorded_duration_s=job.duration_s,
                granularity_ms=dp.granularity_ms,
                memory_bytes=dp.peak_rank_memory_bytes,
                speed=speeds(job) if speeds is not None else None,
            )
        )
    return tuple(jobs)


def run_policies(
    jobs: Sequence[SimJob],
    *,
    policies: Sequence[str],
    cluster: ClusterSpec,
    book: PlanBook,
    interference: InterferenceModel,
    restart_penalty_s: float = DEFAULT_RESTART_PENALTY_S,
    progress: Callable[[str], Callable[[int], None]] = lambda name: (lambda done: None),
) -> tuple[SimResult, ...]:
    """One engine run per policy, on the same jobs and Plans."""
    results = []
    for name in policies:
        engine = Simulation(
            cluster=cluster,
            jobs=jobs,
            policy=policy_named(name),
            facts=book.facts,
            interference=interference,
            restart_penalty_s=restart_penalty_s,
            on_progress=progress(name),
        )
        results.append(engine.run())
    return tuple(results)
