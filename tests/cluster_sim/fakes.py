"""Fake Plan facts and job builders for engine tests that need no planner."""

from __future__ import annotations

from pathlib import Path

from deeppool.cluster_sim.plans import PlanFacts, PlanMode
from deeppool.scheduling.choice import ModelChoice
from deeppool.scheduling.contract import SimJob

DATA = Path(__file__).parent / "data"
FAKE_MODEL = ModelChoice(name="fake", path=DATA / "tiny_mlp.py", global_batch=64)


def fake_facts(model: ModelChoice, gpus: int, mode: PlanMode) -> PlanFacts:
    """Data parallel: 1/g s per iteration, no idle rank. Burst: rank 0 always busy, the rest half idle, 20% faster."""
    if mode is PlanMode.DATA_PARALLEL or gpus == 1:
        return PlanFacts(iteration_s=1.0 / gpus, gpu_seconds_per_iteration=1.0, idle_fractions=(0.0,) * gpus)
    iteration = 0.8 / gpus
    idle = (0.0,) + (0.5,) * (gpus - 1)
    return PlanFacts(iteration_s=iteration, gpu_seconds_per_iteration=iteration * (gpus - 0.5 * (gpus - 1)), idle_fractions=idle)


def make_job(job_id: int, *, arrival: float, gpus: int, iterations: float, background: bool = False) -> SimJob:
    return SimJob(
        job_id=job_id,
        name=f"job-{job_id}",
        arrival_s=arrival,
        gpus=gpus,
        background=background,
        model=FAKE_MODEL,
        iterations=iterations,
        recorded_duration_s=iterations / gpus,
    )
