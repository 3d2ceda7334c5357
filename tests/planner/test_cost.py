"""The cost model's terms match the formulas in its docstring."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from deeppool.planner.cost import CostModel, Optimizer
from deeppool.planner.hardware import NetworkModel
from tests.planner import synthetic

GRAPH = synthetic.graph([("a", ("x",), 8_000_000, 40_000), ("b", ("a",), 0, 40_000)])
NETWORK = NetworkModel(
    gpus_per_node=4, intra_bandwidth=100e9, inter_bandwidth=10e9, intra_latency_s=1e-5, inter_latency_s=5e-5,
    allreduce_efficiency=0.5, allreduce_latency_factor=2.0,
)


def _cost(**changes) -> CostModel:
    profile = synthetic.profile(GRAPH, {"a": 0.1, "b": 0.01}, 0.05, (1, 2, 4, 8, 16, 32))
    return replace(CostModel(graph=GRAPH, profile=profile, network=NETWORK, global_batch=32), **changes)


def test_allreduce_uses_the_measured_efficiency_and_crosses_nodes():
    cost, a = _cost(), GRAPH.layer("a")
    inside = 2 * 3 / 4 * 8e6 / (0.5 * 100e9) + 2 * 2 * 2.0 * 1e-5
    across = 2 * 7 / 8 * 8e6 / (0.5 * 10e9) + 2 * 3 * 2.0 * 5e-5
    assert cost.allreduce_ms(a, 4) == pytest.approx(1e3 * inside)
    assert cost.allreduce_ms(a, 8) == pytest.approx(1e3 * across)
    assert cost.allreduce_ms(a, 1) == 0 and cost.allreduce_ms(GRAPH.layer("b"), 4) == 0


def test_reshard_is_the_larger_side_and_free_between_equal_counts():
    cost, a = _cost(), GRAPH.layer("a")
    side = {g: 1e3 * (NETWORK.latency_s(g) + 40_000 * math.ceil(32 / g) / NETWORK.bandwidth(g)) for g in (2, 8)}
    assert cost.reshard_ms(a, 2, 8) == pytest.approx(max(side.values()))
    assert cost.reshard_ms(a, 8, 8) == 0


def test_optimizer_step_and_memory_follow_the_optimizer():
    sgd, adam = _cost(), _cost(optimizer=Optimizer.ADAM)
    a = GRAPH.layer("a")
    assert adam.step_ms(a) == pytest.approx(7 / 3 * sgd.step_ms(a))
    assert adam.memory_bytes(a, 4) - sgd.memory_bytes(a, 4) == 2 * 8_000_000
    assert sgd.iteration_ms({"a": 4, "b": 2}) == pytest.approx(
        sgd.layer_ms(a, 4) + sgd.layer_ms(GRAPH.layer("b"), 2) + 2 * sgd.reshard_ms(a, 4, 2)
    )
