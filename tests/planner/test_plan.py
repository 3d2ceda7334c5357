"""The Plan: JSON round trip, validation, predictions derived from the cost model."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from deeppool.errors import DeeppoolError
from deeppool.plans import Plan, sample_ranges
from deeppool.planner.api import PlanRequest, plan_graph
from deeppool.planner.solve.cost import PhaseKind
from tests.planner import synthetic
from tests.planner.test_ilp import BASES, RESIDUAL, SLOW_NETWORK, SPEC


@pytest.fixture(scope="module")
def planned():
    profile = synthetic.profile(RESIDUAL, BASES, 0.05, tuple(range(1, 11)))
    return plan_graph(RESIDUAL, profile, SLOW_NETWORK, PlanRequest(gpus=4, global_batch=10), model=SPEC)


def test_json_round_trip_and_contract_keys(planned, tmp_path):
    path = tmp_path / "plan.json"
    planned.plan.save(path)
    assert Plan.load(path) == planned.plan
    payload = json.loads(path.read_text())
    for key in ("schema_version", "model", "global_batch", "gpus", "device", "layers", "predicted", "solver"):
        assert key in payload
    for key in ("name", "op", "gpus", "ranks", "samples", "fwd_ms", "bwd_ms"):
        assert key in payload["layers"][0]
    for key in ("iteration_ms", "data_parallel_iteration_ms", "speedup_vs_data_parallel",
                "gpu_seconds_per_iteration", "amplification", "idle_gpu_fraction", "idle_windows"):
        assert key in payload["predicted"]
    for key in ("name", "status", "seconds", "gap"):
        assert key in payload["solver"]


def test_uneven_sample_ranges_cover_the_batch():
    assert sample_ranges(10, 4) == ((0, 2), (2, 5), (5, 7), (7, 10))


def test_schedule_idle_windows_and_gpu_time_agree(planned):
    plan, cost = planned.plan, planned.cost
    phases = cost.schedule(plan.assignment)
    assert phases[-1].end_ms == pytest.approx(plan.predicted.iteration_ms)
    busy = sum((p.end_ms - p.start_ms) * p.ranks for p in phases)
    idle = sum(w.length_ms for w in plan.predicted.idle_windows)
    assert busy + idle == pytest.approx(plan.predicted.iteration_ms * plan.gpus)
    assert {p.kind for p in phases} >= {PhaseKind.FORWARD, PhaseKind.BACKWARD}
    for window in plan.predicted.idle_windows:
        assert all(not (p.ranks > window.rank and p.start_ms < window.end_ms - 1e-9 and p.end_ms > window.start_ms + 1e-9)
                   for p in phases)


def test_wrong_version_corrupted_and_inconsistent_plans_are_refused(planned, tmp_path):
    payload = planned.plan.to_json()
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**payload, "schema_version": 99}))
    with pytest.raises(DeeppoolError, match="schema_version 99"):
        Plan.load(path)
    path.write_text(json.dumps(payload)[:-20])
    with pytest.raises(DeeppoolError, match="not valid JSON"):
        Plan.load(path)
    broken = dict(payload, layers=[dict(payload["layers"][0], samples=[[0, 3]] * payload["layers"][0]["gpus"])])
    path.write_text(json.dumps(broken))
    with pytest.raises(DeeppoolError, match=r"layer 'a' rank \d+: samples"):
        Plan.load(path)
    with pytest.raises(DeeppoolError, match="outside 1..4"):
        replace(planned.plan, layers=(replace(planned.plan.layers[0], gpus=9),))
