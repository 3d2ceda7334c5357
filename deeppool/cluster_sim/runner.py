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
from deeppool.planner.profiling.interference import InterferenceModel, Pieces
from deeppool.scheduling.choice import ModelChoice
from deeppool.scheduling.contract import SimJob, SpeedModel
from deeppool.scheduling.policies import policy_named

DEFAULT_RESTART_PENALTY_S = 30.0
"""Time lost each time a preempted or evicted job runs again: the Pollux artifact simulator's restart delay."""
DEFAULT_REPLAN_PENALTY_S = DEFAULT_RESTART_PENALTY_S
"""Time a running job loses when a policy moves it to another plan. An assumption: deeppool re-plans a running
job by a checkpoint and a restart on the new plan (``docs/adaptation.md``), so a restart's delay, until the live
coordinator measures what its resizes cost (issue 43)."""


@dataclass(frozen=True, kw_only=True)
class Assignment:
    """Workload jobs with their models, before their work is known."""

    jobs: tuple[TraceJob, ...]
    models: tuple[ModelChoice, ...]
    background: tuple[bool, ...]
    dropped: int

    def needs(self) -> list[tuple[ModelChoice, int]]:
        """Every distinct (model, GPU count), largest first (the slow solves show early), and every background
        model at one row on one GPU (its pieces: :func:`piece_ms`)."""
        pairs = dict.fromkeys(zip(self.models, (job.gpus for job in self.jobs), strict=True))
        rows = dict.fromkeys((one_row(model), 1) for model, bg in zip(self.models, self.background, strict=True) if bg)
        return sorted(pairs, key=lambda pair: (-pair[1], pair[0].name)) + [row for row in rows if row not in pairs]


def for_pieces(interference: InterferenceModel, pieces: Pieces) -> InterferenceModel:
    """``interference`` with the piece the lending plans are chosen for: the mode's (:attr:`Pieces.planning_ms`)."""
    return replace(interference, bg_piece_ms=pieces.planning_ms)


def one_row(model: ModelChoice) -> ModelChoice:
    """``model`` at a batch of one row: what a micro-step of one row runs."""
    return replace(model, global_batch=1, per_gpu_batch=None)


def piece_ms(model: ModelChoice, gpus: int, book: PlanBook, pieces: Pieces) -> float:
    """A background job's piece under the multiplexing mode (:class:`Pieces`), from its own data-parallel
    plans: at its batch on its GPUs, and at one row on one GPU."""
    own = book.facts(model, gpus, PlanMode.DATA_PARALLEL)
    row = book.facts(one_row(model), 1, PlanMode.DATA_PARALLEL)
    return pieces.piece_ms(phase_ms=own.granularity_ms, row_phase_ms=row.granularity_ms,
                           row_step_ms=row.iteration_s * 1e3)


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
             speeds: Callable[[TraceJob], SpeedModel] | None = None, *, pieces: Pieces | None = None) -> tuple[SimJob, ...]:
    """Each job's work: its recorded duration over its recorded allocation's data-parallel iteration time.

    A background job's step comes in the pieces of the multiplexing mode ``pieces`` (default ``priority``);
    a foreground job's granularity is its longest layer phase. With ``speeds`` each job also gets its speed
    model, which co-adaptive policies run it by.
    """
    pieces = Pieces() if pieces is None else pieces
    jobs, granularity = [], {}
    for index, (job, model, background) in enumerate(
        zip(assignment.jobs, assignment.models, assignment.background, strict=True)
    ):
        dp = book.facts(model, job.gpus, PlanMode.DATA_PARALLEL)
        key = (id(model), job.gpus)
        if background and key not in granularity:
            granularity[key] = piece_ms(model, job.gpus, book, pieces)
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
                granularity_ms=granularity[key] if background else dp.granularity_ms,
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
    replan_penalty_s: float = DEFAULT_REPLAN_PENALTY_S,
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
            replan_penalty_s=replan_penalty_s,
            on_progress=progress(name),
        )
        results.append(engine.run())
    return tuple(results)
