"""The simulator agrees with the planner: a job alone runs at its Plan's predicted speed."""

from __future__ import annotations

import pytest

from deeppool.cluster_sim.engine import Simulation
from deeppool.cluster_sim.models import ModelMapping
from deeppool.cluster_sim.plans import PlanFacts, PlanMode
from deeppool.cluster_sim.runner import assign, sim_jobs
from deeppool.cluster_sim.workload import BackgroundRule, TraceFormat, TraceJob, Workload
from deeppool.planner.api import PlanRequest, device_setup, plan_graph
from deeppool.planner.profiling.interference import InterferenceModel
from deeppool.scheduling.policies import POLICIES


def _alone(tiny, gpus: int, duration_s: float) -> Workload:
    job = TraceJob(name="alone", arrival_s=5.0, gpus=gpus, duration_s=duration_s, key="tiny", where="test")
    return Workload(source="test", format=TraceFormat.SYNTHETIC, jobs=(job,))


@pytest.mark.parametrize("gpus", [1, 4, 16])
def test_single_job_iteration_time_equals_the_planners_prediction(book, cluster, tiny, gpus) -> None:
    graph = book.graph(tiny)
    profile, _ = device_setup("a100", tiny.global_batch, tiny.global_batch, graph)
    plan = plan_graph(graph, profile, cluster.network, PlanRequest(gpus=gpus, global_batch=tiny.global_batch), model=tiny.spec).plan
    assignment = assign(_alone(tiny, gpus, 600.0), mapping=ModelMapping(fallback=tiny), rule=BackgroundRule(),
                        cluster=cluster, seed=0, drop_oversized=False)
    (job,) = sim_jobs(assignment, book)
    for policy, predicted_ms in (("burst", plan.predicted.iteration_ms), ("dp", plan.predicted.data_parallel_iteration_ms)):
        engine = Simulation(cluster=cluster, jobs=[job], policy=POLICIES[policy], facts=book.facts,
                            interference=InterferenceModel(), restart_penalty_s=0.0)
        (record,) = engine.run().records
        assert record.jct_s / job.iterations == pytest.approx(predicted_ms / 1e3, rel=1e-9), policy
    assert PlanFacts.of(plan) == book.facts(tiny, gpus, PlanMode.BURST)


def test_recorded_duration_is_replayed_exactly_under_data_parallel(book, cluster, tiny) -> None:
    assignment = assign(_alone(tiny, 4, 1234.5), mapping=ModelMapping(fallback=tiny), rule=BackgroundRule(),
                        cluster=cluster, seed=0, drop_oversized=False)
    (job,) = sim_jobs(assignment, book)
    engine = Simulation(cluster=cluster, jobs=[job], policy=POLICIES["dp"], facts=book.facts,
                        interference=InterferenceModel(), restart_penalty_s=0.0)
    (record,) = engine.run().records
    assert record.jct_s == pytest.approx(1234.5, rel=1e-9)


def test_burst_plans_never_run_slower_than_data_parallel(book, tiny) -> None:
    for gpus in (1, 2, 4, 8, 16):
        burst = book.facts(tiny, gpus, PlanMode.BURST)
        dp = book.facts(tiny, gpus, PlanMode.DATA_PARALLEL)
        assert burst.iteration_s <= dp.iteration_s * (1 + 1e-9)
        assert len(burst.idle_fractions) == gpus and all(0 <= f <= 1 for f in burst.idle_fractions)


def test_plans_are_cached_on_disk(book, cluster, tiny) -> None:
    from deeppool.cluster_sim.plans import PlanBook

    book.facts(tiny, 2, PlanMode.BURST)
    again = PlanBook(cluster=cluster, settings=book.settings, cache_dir=book.cache_dir)
    assert again.facts(tiny, 2, PlanMode.BURST) == book.facts(tiny, 2, PlanMode.BURST)
    assert again.solved == 0
