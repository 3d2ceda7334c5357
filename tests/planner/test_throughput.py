"""`--objective cluster`: the exact search equals enumerating every assignment, and plans keep their shares."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from deeppool.plans import Objective, Plan
from deeppool.planner.api import PlanRequest, plan_graph
from deeppool.planner.profiling.interference import InterferenceModel
from deeppool.planner.solve import baselines
from deeppool.planner.solve.candidates import useful_counts
from deeppool.planner.solve.ilp import Ilp
from deeppool.planner.solve.throughput import ClusterProblem, cluster_optimum, right_sizing, shares
from tests.entry import deeppool
from tests.planner.test_ilp import CHAIN, RESIDUAL, SLOW_NETWORK, SPEC, _problem
from tests.planner.test_plan_options import A100

GPUS, BATCH = 4, 12
"""Every count 1..4 is useful at batch 12, so the search's candidates are all the counts enumerated."""
MODELS = {
    "defaults": InterferenceModel(),
    "curve": InterferenceModel(fg_slowdown=1.02, efficiency_by_window_ms=((0.5, 0.3), (2.0, 0.6), (8.0, 0.9)),
                               min_lend_fraction=0.05),
    "ideal": InterferenceModel(fg_slowdown=1.0, bg_efficiency=1.0, min_lend_fraction=0.0),
    # lending costs more than it yields: the best plan may lend nothing, found by the loop over the fastest
    # plans, which must run after the lending loop has proven its side (it once never ran then)
    "costly": InterferenceModel(fg_slowdown=1.2, bg_efficiency=0.3, min_lend_fraction=0.15),
    "slow-host": InterferenceModel(fg_slowdown=1.5, bg_efficiency=0.9, min_lend_fraction=0.15),
    # a guest whose steps come in 3 ms pieces: windows hold only whole pieces (the chain's best plan changes)
    "pieces": InterferenceModel(bg_piece_ms=3.0),
    # pieces longer than most ranks' idle time: most windows of busy ranks hold nothing
    "long-pieces": InterferenceModel(bg_piece_ms=8.0),
}


def _enumerate(cost, model: InterferenceModel, dp_ms: float) -> float:
    names = cost.graph.names
    return max(
        shares(cost, dict(zip(names, counts, strict=True)), gpus=GPUS, dp_ms=dp_ms, model=model).throughput
        for counts in itertools.product(range(1, GPUS + 1), repeat=len(names))
    )


@pytest.mark.parametrize("model", list(MODELS), ids=list(MODELS))
@pytest.mark.parametrize("graph", [CHAIN, RESIDUAL], ids=["chain", "residual"])
def test_exact_search_equals_enumeration_of_every_assignment(graph, model):
    assert useful_counts(GPUS, BATCH) == tuple(range(1, GPUS + 1))
    cost, _ = _problem(graph, GPUS, BATCH)
    interference = MODELS[model]
    dp_ms = cost.iteration_ms(baselines.data_parallel(cost, GPUS))
    options = dict.fromkeys(graph.names, tuple(range(1, GPUS + 1)))
    fastest = min(cost.iteration_ms(dict(zip(graph.names, c, strict=True)))
                  for c in itertools.product(range(1, GPUS + 1), repeat=len(graph.names)))
    problem = ClusterProblem(cost=cost, options=options, gpus=GPUS, dp_ms=dp_ms, model=interference,
                             memory_bytes=None, time_limit_s=60.0, solver=None, fastest_ms=fastest, tolerance=0.0)
    found = cluster_optimum(problem, [baselines.data_parallel(cost, g) for g in range(1, GPUS + 1)])
    assert found.proven and "optimal (" in found.status
    assert found.shares.throughput == pytest.approx(_enumerate(cost, interference, dp_ms), rel=1e-9)
    assert found.costed < GPUS ** len(graph.names), "the bound must spare most of the enumeration"


def test_shares_of_data_parallel_and_right_sizing():
    cost, _ = _problem(CHAIN, GPUS, BATCH)
    dp_ms = cost.iteration_ms(baselines.data_parallel(cost, GPUS))
    everything = shares(cost, baselines.data_parallel(cost, GPUS), gpus=GPUS, dp_ms=dp_ms, model=InterferenceModel())
    assert (everything.fg_share, everything.bg_share, everything.lent_fraction) == (1.0, 0.0, 0.0)
    half = shares(cost, baselines.data_parallel(cost, 2), gpus=GPUS, dp_ms=dp_ms, model=MODELS["ideal"])
    assert half.bg_share == pytest.approx(0.5) and half.lent_fraction == pytest.approx(0.5)
    width, value = right_sizing(cost, GPUS, dp_ms)
    assert value == pytest.approx(max(dp_ms / cost.iteration_ms(baselines.data_parallel(cost, g)) + (GPUS - g) / GPUS
                                      for g in range(1, GPUS + 1)))
    assert value == pytest.approx(dp_ms / cost.iteration_ms(baselines.data_parallel(cost, width)) + (GPUS - width) / GPUS)


@pytest.mark.parametrize("graph", [CHAIN, RESIDUAL], ids=["chain", "residual"])
def test_the_cluster_plan_is_never_below_any_data_parallel_width_and_round_trips(graph):
    cost, profile = _problem(graph, GPUS, BATCH)
    request = PlanRequest(gpus=GPUS, global_batch=BATCH, objective=Objective.CLUSTER)
    plan = plan_graph(graph, profile, SLOW_NETWORK, request, model=SPEC).plan
    dp_ms = plan.predicted.data_parallel_iteration_ms
    assert plan.objective is Objective.CLUSTER and plan.cluster is not None
    assert plan.cluster.throughput >= _enumerate(cost, InterferenceModel(), dp_ms) * (1 - 2e-3)
    for g in range(1, GPUS + 1):
        width = shares(cost, baselines.data_parallel(cost, g), gpus=GPUS, dp_ms=dp_ms, model=InterferenceModel())
        assert plan.cluster.throughput >= width.throughput - 1e-12
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    fastest = plan_graph(graph, profile, SLOW_NETWORK, PlanRequest(gpus=GPUS, global_batch=BATCH), model=SPEC).plan
    assert fastest.objective is Objective.TIME and fastest.cluster.throughput <= plan.cluster.throughput + 1e-12


def test_plan_prints_both_shares_and_both_baselines(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = deeppool(capsys, *A100, "--batch", "8", "--objective", "cluster", "--out", "p.json")
    assert result.code == 0, result
    assert "foreground share" in result.stdout and "background share" in result.stdout
    assert "x data parallel on all 2 GPUs" in result.stdout and "x right-sizing (data parallel on" in result.stdout
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["objective"] == "cluster" and {"fg_share", "bg_share", "right_sizing_throughput"} <= set(saved["cluster"])


def test_a_missing_interference_file_is_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = deeppool(capsys, *A100, "--objective", "cluster", "--interference", "none.json")
    lines = result.stderr.strip().splitlines()
    assert result.code == 2 and len(lines) == 1 and "--interference" in lines[0], result
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("graph", [CHAIN, RESIDUAL], ids=["chain", "residual"])
def test_cluster_gap_zero_through_the_request_is_the_enumerated_best(graph):
    cost, profile = _problem(graph, GPUS, BATCH)
    request = PlanRequest(gpus=GPUS, global_batch=BATCH, objective=Objective.CLUSTER, cluster_gap=0.0)
    plan = plan_graph(graph, profile, SLOW_NETWORK, request, model=SPEC).plan
    best = _enumerate(cost, InterferenceModel(), plan.predicted.data_parallel_iteration_ms)
    assert plan.cluster.throughput == pytest.approx(best, rel=1e-9)
    assert plan.solver.gap == 0.0 and "optimal (" in plan.solver.status


def test_a_cluster_gap_out_of_range_is_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = deeppool(capsys, *A100, "--objective", "cluster", "--cluster-gap", "-0.1")
    lines = result.stderr.strip().splitlines()
    assert result.code == 2 and len(lines) == 1 and "--cluster-gap" in lines[0], result
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("model", ["defaults", "curve", "pieces"])
def test_a_solve_stopped_at_its_limit_bounds_by_its_lower_bound_not_its_incumbent(monkeypatch, model):
    """A solve that stops at a limit returns an incumbent above the minimum; the search must read the
    solver's lower bound, ``objective · (1 − gap)``, or it stops while a better plan is left. Each solve here
    reports the true minimiser as if stopped early: objective 1.5x the minimum, lower bound 0.9x."""
    real = Ilp.solve

    def stopped_early(self, **kwargs):
        found = real(self, **kwargs)
        return dataclasses.replace(found, optimal=False, objective=found.objective * 1.5, gap=0.4)

    monkeypatch.setattr(Ilp, "solve", stopped_early)
    cost, _ = _problem(CHAIN, GPUS, BATCH)
    interference = MODELS[model]
    dp_ms = cost.iteration_ms(baselines.data_parallel(cost, GPUS))
    problem = ClusterProblem(cost=cost, options=dict.fromkeys(CHAIN.names, tuple(range(1, GPUS + 1))), gpus=GPUS,
                             dp_ms=dp_ms, model=interference, memory_bytes=None, time_limit_s=60.0, solver=None,
                             fastest_ms=0.0, tolerance=0.0)
    found = cluster_optimum(problem, [baselines.data_parallel(cost, g) for g in range(1, GPUS + 1)])
    assert found.shares.throughput == pytest.approx(_enumerate(cost, interference, dp_ms), rel=1e-9)
    assert found.bound >= found.shares.throughput


def test_an_ilp_result_stopped_early_states_its_lower_bound():
    cost, _ = _problem(CHAIN, GPUS, BATCH)
    result = Ilp(cost, dict.fromkeys(CHAIN.names, (1, 2)), memory_bytes=None).solve(time_limit_s=10.0)
    assert result.optimal and result.least == result.objective > 0
    stopped = dataclasses.replace(result, optimal=False, gap=0.25)
    assert stopped.least == pytest.approx(0.75 * result.objective)
    assert dataclasses.replace(result, optimal=False, gap=1.0).least == 0.0
