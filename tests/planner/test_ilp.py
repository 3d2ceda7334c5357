"""The ILP is optimal (equals enumeration), respects its hard limits and beats its baselines."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from deeppool.errors import DeeppoolError
from deeppool.plans import ModelSource, ModelSpec, NetworkModel, Objective, Strategy
from deeppool.planner.api import PlanRequest, plan_graph
from deeppool.planner.hardware import NETWORKS, KnownDevice
from deeppool.planner.pareto import front, plot
from deeppool.planner.solve import baselines
from deeppool.planner.solve.candidates import useful_counts
from deeppool.planner.solve.cost import CostModel
from deeppool.planner.solve.ilp import Ilp, SolverName
from deeppool.planner.solve.throughput import priced_gpu_ms
from tests.planner import synthetic

SPEC = ModelSpec(source=ModelSource.FACTORY, location="tests.models.factories:small_cnn", input_shape=(3, 8, 8))
SLOW_NETWORK = NetworkModel(
    gpus_per_node=2, intra_bandwidth=2e9, nics_per_node=2, nic_bandwidth=0.2e9, intra_latency_s=2e-5, inter_latency_s=1e-4
)

CHAIN = synthetic.graph([
    ("a", ("x",), 4_000_000, 400_000),
    ("b", ("a",), 0, 400_000),
    ("c", ("b",), 40_000_000, 4_000),
    ("d", ("c",), 400_000, 4_000),
])
RESIDUAL = synthetic.graph([
    ("a", ("x",), 400_000, 40_000),
    ("b", ("a",), 4_000_000, 40_000),
    ("c", ("b",), 40_000, 400_000),
    ("d", ("c", "a"), 0, 40_000),
    ("e", ("d",), 4_000_000, 4_000),
])
BASES = {"a": 0.5, "b": 0.05, "c": 2.0, "d": 0.01, "e": 0.3}


SYNCING_NETWORK = replace(SLOW_NETWORK, wakeup_s=4e-4, allreduce_overlap=0.0)
"""gloo on a host's shared cores: the first message after ranks computed together waits, and no
all-reduce hides behind the backward (so a group's latency rounds grow with its buckets)."""
SKEWED_NETWORK = replace(SYNCING_NETWORK, skew={2: 0.05, 4: 0.3}, skew_after_s=0.5e-3)
"""... and ranks time-sliced on its cores finish apart: a group's collective waits longer the more it
computed (past 0.5 ms; the chain's layers compute 0.01 to 2 ms each)."""


def _problem(graph, gpus: int, batch: int, network: NetworkModel = SLOW_NETWORK) -> tuple[CostModel, dict]:
    batches = tuple(range(1, batch + 1))
    profile = synthetic.profile(graph, {n: BASES[n] for n in graph.names}, 0.05, batches)
    return CostModel(graph=graph, profile=profile, network=network, global_batch=batch), profile


def _enumerate(cost: CostModel, gpus: int, amplification: float | None = None) -> float:
    """The best iteration time over every count 1..gpus of every layer."""
    best = float("inf")
    names = cost.graph.names
    for counts in itertools.product(range(1, gpus + 1), repeat=len(names)):
        assignment = dict(zip(names, counts, strict=True))
        if amplification is not None and any(
            g > 1 and cost.amplification(cost.graph.layer(n), g) > amplification for n, g in assignment.items()
        ):
            continue
        best = min(best, cost.iteration_ms(assignment))
    return best


@pytest.mark.parametrize("network", [SLOW_NETWORK, SYNCING_NETWORK, SKEWED_NETWORK],
                         ids=["network", "sync-latency", "skew"])
@pytest.mark.parametrize("graph", [CHAIN, RESIDUAL], ids=["chain", "residual"])
@pytest.mark.parametrize("solver", list(SolverName))
def test_ilp_equals_exhaustive_enumeration_over_all_counts(graph, solver, network):
    gpus, batch = 6, 12
    cost, profile = _problem(graph, gpus, batch, network)
    planned = plan_graph(graph, profile, network, PlanRequest(gpus=gpus, global_batch=batch, solver=solver), model=SPEC)
    assert planned.plan.solver.status.startswith("optimal")
    assert planned.plan.predicted.iteration_ms == pytest.approx(_enumerate(cost, gpus), rel=1e-6)
    assert planned.plan.predicted.iteration_ms == pytest.approx(cost.iteration_ms(planned.plan.assignment))


def test_amplification_limit_is_hard_and_still_optimal():
    gpus, batch, limit = 6, 12, 1.5
    cost, profile = _problem(RESIDUAL, gpus, batch)
    request = PlanRequest(gpus=gpus, global_batch=batch, amplification=limit)
    plan = plan_graph(RESIDUAL, profile, SLOW_NETWORK, request, model=SPEC).plan
    assert all(layer.amplification <= limit + 1e-9 for layer in plan.layers)
    assert plan.predicted.iteration_ms == pytest.approx(_enumerate(cost, gpus, limit), rel=1e-6)
    unlimited = plan_graph(RESIDUAL, profile, SLOW_NETWORK, PlanRequest(gpus=gpus, global_batch=batch), model=SPEC).plan
    assert any(layer.amplification > limit for layer in unlimited.layers), "the limit must bind in this test"


def test_pruned_counts_are_the_smallest_per_gpu_batch():
    assert useful_counts(8, 8) == (1, 2, 3, 4, 8)
    assert useful_counts(1024, 256)[-3:] == (86, 128, 256)
    assert useful_counts(32, 10) == (1, 2, 3, 4, 5, 10)


def test_memory_limit_binds_and_infeasible_names_the_layer():
    gpus, batch = 4, 64
    cost, profile = _problem(CHAIN, gpus, batch)
    synchronous = PlanRequest(gpus=gpus, global_batch=batch, bucket_mb=0)  # all-reduce per layer: fewer GPUs pay
    slow = NetworkModel.flat(gpus_per_node=2, bandwidth=0.05e9, latency_s=1e-4)
    free = plan_graph(CHAIN, profile, slow, synchronous, model=SPEC).plan
    assert free.predicted.peak_memory_bytes > cost.peak_memory_bytes(dict.fromkeys(CHAIN.names, gpus))
    tight = free.predicted.peak_memory_bytes - 2**20
    tight_profile = synthetic.profile(CHAIN, {n: BASES[n] for n in CHAIN.names}, 0.05, profile.layers["a"].batches, tight)
    bounded = plan_graph(CHAIN, tight_profile, slow, synchronous, model=SPEC).plan
    assert bounded.predicted.peak_memory_bytes <= tight
    tiny = synthetic.profile(CHAIN, {n: BASES[n] for n in CHAIN.names}, 0.05, (1, 64), memory_bytes=1_000_000)
    with pytest.raises(DeeppoolError, match="infeasible.*layer 'c'"):
        plan_graph(CHAIN, tiny, SLOW_NETWORK, PlanRequest(gpus=gpus, global_batch=batch), model=SPEC)


def test_ilp_never_slower_than_baselines_and_strategy_picks_the_plan():
    gpus, batch = 8, 16
    cost, profile = _problem(RESIDUAL, gpus, batch)
    network = NETWORKS[KnownDevice.A100]
    planned = plan_graph(RESIDUAL, profile, network, PlanRequest(gpus=gpus, global_batch=batch), model=SPEC)
    predicted = planned.plan.predicted
    assert predicted.iteration_ms <= predicted.data_parallel_iteration_ms + 1e-9
    assert predicted.iteration_ms <= predicted.deeppool_iteration_ms + 1e-9
    assert predicted.iteration_ms <= predicted.best_data_parallel_iteration_ms + 1e-9
    cost = planned.cost
    best = min(range(1, gpus + 1), key=lambda g: cost.iteration_ms(dict.fromkeys(RESIDUAL.names, g)))
    assert predicted.best_data_parallel_iteration_ms == pytest.approx(cost.iteration_ms(dict.fromkeys(RESIDUAL.names, best)))
    assert predicted.speedup_vs_best_data_parallel == pytest.approx(
        predicted.best_data_parallel_iteration_ms / predicted.iteration_ms)
    dp = plan_graph(RESIDUAL, profile, network, PlanRequest(gpus=gpus, global_batch=batch, strategy=Strategy.DATA_PARALLEL), model=SPEC).plan
    assert {layer.gpus for layer in dp.layers} == {8}
    assert dp.predicted.iteration_ms == pytest.approx(predicted.data_parallel_iteration_ms)


def test_deeppool_baseline_uses_powers_of_two():
    cost, _ = _problem(CHAIN, 6, 12)
    assignment = baselines.deeppool(cost, 6, amplification=2.0)
    assert set(assignment.values()) <= {1, 2, 4}


def test_deeppool_takes_the_slowest_branch_at_a_join_and_is_no_worse_than_its_data_parallel():
    cost, _ = _problem(RESIDUAL, 8, 16)
    assignment = baselines.deeppool(cost, 8, amplification=None)
    uniform = min(cost.iteration_ms(dict.fromkeys(RESIDUAL.names, g)) for g in (1, 2, 4, 8))
    assert set(assignment) == set(RESIDUAL.names)
    assert cost.iteration_ms(assignment) <= uniform + 1e-9  # data parallel is in its search space


def test_thinned_candidates_say_so_and_a_failed_solve_keeps_the_best_baseline(monkeypatch):
    cost, profile = _problem(CHAIN, 64, 64)
    thinned = plan_graph(CHAIN, profile, SLOW_NETWORK, PlanRequest(gpus=64, global_batch=64, max_candidates=4),
                         model=SPEC).plan
    assert "candidate counts" in thinned.solver.status and thinned.solver.status.startswith("optimal over")

    def fails(*args, **kwargs):
        raise DeeppoolError("the ILP found no plan (Not Solved) within 1 s")

    monkeypatch.setattr("deeppool.planner.strategies.solve", fails)
    kept = plan_graph(CHAIN, profile, SLOW_NETWORK, PlanRequest(gpus=8, global_batch=64), model=SPEC).plan
    assert "no ILP solution" in kept.solver.status and "kept the best feasible baseline" in kept.solver.status
    assert kept.predicted.iteration_ms == pytest.approx(min(
        kept.predicted.best_data_parallel_iteration_ms, kept.predicted.deeppool_iteration_ms))


def test_pricing_gpu_time_trades_iteration_time_for_gpu_seconds_and_the_front_is_drawn(tmp_path):
    gpus, batch = 8, 16
    _, profile = _problem(RESIDUAL, gpus, batch)
    fast = plan_graph(RESIDUAL, profile, SLOW_NETWORK, PlanRequest(gpus=gpus, global_batch=batch), model=SPEC)
    dear = PlanRequest(gpus=gpus, global_batch=batch, objective=Objective.TIME_AND_GPU_TIME, price=1e4)
    frugal = plan_graph(RESIDUAL, profile, SLOW_NETWORK, dear, model=SPEC).plan.predicted
    assert frugal.gpu_seconds_per_iteration <= fast.plan.predicted.gpu_seconds_per_iteration + 1e-12
    assert frugal.iteration_ms >= fast.plan.predicted.iteration_ms - 1e-9
    drawn = front(fast)
    times = [p.iteration_ms for p in drawn.ilp]
    assert times == sorted(times, reverse=True), "along the front, more GPU-time buys less iteration time"
    assert drawn.ilp[-1].iteration_ms == pytest.approx(fast.plan.predicted.iteration_ms)
    plot(drawn, tmp_path / "front.png")
    assert (tmp_path / "front.png").stat().st_size > 10_000
    with pytest.raises(DeeppoolError, match="needs a --price"):
        PlanRequest(gpus=gpus, global_batch=batch, objective=Objective.TIME_AND_GPU_TIME)


def test_a_cutoff_prunes_only_what_lies_above_it():
    """HiGHS with a cutoff: just above the best plan outside the cut it returns that plan's time; just
    below it, no plan is left (infeasible), the answer the cluster search stops on."""
    gpus, batch = 6, 12
    cost, _ = _problem(RESIDUAL, gpus, batch)
    options = {name: tuple(range(1, gpus + 1)) for name in RESIDUAL.names}
    ilp = Ilp(cost, options, memory_bytes=None, solver=SolverName.HIGHS)
    first = ilp.solve(time_limit_s=30).assignment
    times = sorted(cost.iteration_ms(dict(zip(RESIDUAL.names, counts, strict=True)))
                   for counts in itertools.product(range(1, gpus + 1), repeat=len(RESIDUAL.names)))
    second = next(t for t in times if t > cost.iteration_ms(first) * (1 + 1e-9))
    found = ilp.solve(exclude=[first], cutoff=second * (1 + 1e-6), time_limit_s=30).assignment
    assert cost.iteration_ms(found) == pytest.approx(second, rel=1e-6)
    with pytest.raises(DeeppoolError, match="Infeasible"):
        ilp.solve(exclude=[first], cutoff=second * (1 - 1e-6), time_limit_s=30)
    assert cost.iteration_ms(ilp.solve(time_limit_s=30).assignment) == pytest.approx(cost.iteration_ms(first))


@pytest.mark.parametrize("network", [SLOW_NETWORK, SYNCING_NETWORK, SKEWED_NETWORK],
                         ids=["network", "sync-latency", "skew"])
@pytest.mark.parametrize("graph", [CHAIN, RESIDUAL], ids=["chain", "residual"])
def test_reshard_pairs_price_a_plans_busy_gpu_time_exactly(graph, network):
    """With ``reshard_pairs`` the ILP's ``time + price · gpu_time`` of every assignment is its iteration time
    plus ``price`` times its busy GPU-time, reshards included, less only the optimizer's per-call step: the
    cluster search's bound prices the plan's own reshards (the ladders priced a floor of them)."""
    gpus, batch, price = 4, 12, 50.0
    cost, _ = _problem(graph, gpus, batch, network)
    reshards = 0
    for counts in itertools.product(range(1, gpus + 1), repeat=len(graph.names)):
        assignment = dict(zip(graph.names, counts, strict=True))
        fixed = {name: (g,) for name, g in assignment.items()}
        found = Ilp(cost, fixed, memory_bytes=None, solver=SolverName.HIGHS, reshard_pairs=True).solve(
            price=price, time_limit_s=30)
        busy_ms = 1e3 * cost.gpu_seconds(assignment) - cost.step_call_ms * max(counts)
        assert found.objective == pytest.approx(cost.iteration_ms(assignment) + price * busy_ms / 1e3,
                                                rel=1e-9), assignment
        layers_only = cost.iteration_ms(assignment) + price * priced_gpu_ms(cost, assignment) / 1e3
        moved = any(assignment[src] != assignment[dst] for src, dst in graph.edges())
        reshards += moved and found.objective > layers_only * (1 + 1e-6)
    assert reshards > 0, "some plan must reshard"


@pytest.mark.parametrize("graph", [CHAIN, RESIDUAL], ids=["chain", "residual"])
def test_reshard_pairs_find_the_same_fastest_plan_as_the_ladders(graph):
    """Pairs and ladders are two exact forms of the same reshards: at price 0 both reach the least time."""
    cost, _ = _problem(graph, 4, 12, SLOW_NETWORK)
    options = dict.fromkeys(graph.names, (1, 2, 3, 4))
    ladders = Ilp(cost, options, memory_bytes=None, solver=SolverName.HIGHS).solve(time_limit_s=30)
    pairs = Ilp(cost, options, memory_bytes=None, solver=SolverName.HIGHS, reshard_pairs=True).solve(time_limit_s=30)
    assert pairs.objective == pytest.approx(ladders.objective, rel=1e-9)
    assert cost.iteration_ms(pairs.assignment) == pytest.approx(ladders.objective, rel=1e-9)
