"""The cost model's terms match the formulas in its docstring."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from deeppool.errors import DeeppoolError
from deeppool.plans import ModelSource, ModelSpec, NetworkModel, Optimizer, Plan, Precision
from deeppool.planner.api import PlanRequest, plan_graph
from deeppool.planner.hardware import DEVICES, KnownDevice
from deeppool.planner.profiling.profile import LayerTimes, StepOverhead, estimate_ms, estimated_profile
from deeppool.planner.solve.cost import CostModel
from tests.planner import synthetic

SPEC = ModelSpec(source=ModelSource.FACTORY, location="tests.models.factories:small_cnn", input_shape=(3, 8, 8))
GRAPH = synthetic.graph([("a", ("x",), 8_000_000, 40_000), ("b", ("a",), 0, 40_000)])
NETWORK = NetworkModel(
    gpus_per_node=4, intra_bandwidth=100e9, nics_per_node=4, nic_bandwidth=10e9, intra_latency_s=1e-5, inter_latency_s=5e-5,
    allreduce_efficiency=0.5, allreduce_latency_factor=2.0,
)


def _cost(**changes) -> CostModel:
    profile = synthetic.profile(GRAPH, {"a": 0.1, "b": 0.01}, 0.05, (1, 2, 4, 8, 16, 32))
    return replace(CostModel(graph=GRAPH, profile=profile, network=NETWORK, global_batch=32), **changes)


def test_ranks_beyond_the_cores_share_them():
    shared = _cost(profile=replace(_cost().profile, concurrent_ranks=2))
    a, alone = GRAPH.layer("a"), _cost()
    assert shared.compute_ms(a, 2) == alone.compute_ms(a, 2)
    assert shared.compute_ms(a, 8) == pytest.approx(tuple(4 * t for t in alone.compute_ms(a, 8)))
    assert alone.profile.sharing(64) == 1.0, "a GPU profile: each rank has its own device"


def test_allreduce_is_hierarchical_across_nodes_with_the_measured_efficiency():
    cost, a = _cost(bucket_bytes=0), GRAPH.layer("a")
    inside = 2 * 3 / 4 * 8e6 / (0.5 * 100e9) + 2 * 2 * 2.0 * 1e-5
    nvlink = 2 * 3 / 4 * 8e6 / (0.5 * 100e9)
    nics = 2 * 1 / 2 * 8e6 / (0.5 * 4 * 10e9)
    across = nvlink + nics + 2.0 * (2 * 2 * 1e-5 + 2 * 1 * 5e-5)
    assert cost.allreduce_ms(a, 4) == pytest.approx(1e3 * inside)
    assert cost.allreduce_ms(a, 8) == pytest.approx(1e3 * across)
    assert cost.allreduce_ms(a, 1) == 0 and cost.allreduce_ms(GRAPH.layer("b"), 4) == 0


def test_bucketed_allreduce_hides_behind_the_backward_except_the_last_bucket():
    three = synthetic.graph([("a", ("x",), 8_000_000, 40_000), ("b", ("a",), 8_000_000, 40_000),
                             ("c", ("b",), 8_000_000, 40_000)])
    profile = synthetic.profile(three, {"a": 0.1, "b": 0.1, "c": 0.1}, 0.05, (1, 2, 4, 8, 16, 32))
    cost = CostModel(graph=three, profile=profile, network=NETWORK, global_batch=32, bucket_bytes=16_000_000)
    copy = 1e3 * 4 * 8e6 / profile.memory_bandwidth  # into the flat bucket and the sums back
    full = {n: 1e3 * NETWORK.allreduce_s(4, 8e6, latencies=0.0) + copy for n in "abc"}
    assert cost.allreduce_ms(three.layer("a"), 4) == pytest.approx(full["a"])  # 24 MB mod 16 MB: a is the last bucket
    hidden = max(0.0, full["b"] - cost.compute_ms(three.layer("b"), 4)[1])
    assert cost.allreduce_ms(three.layer("b"), 4) == pytest.approx(hidden)
    on_cpu = replace(cost, network=replace(NETWORK, allreduce_overlap=0.0))  # gloo competes for the cores
    assert on_cpu.allreduce_ms(three.layer("b"), 4) == pytest.approx(full["b"])
    one_call = replace(cost, bucket_bytes=0)
    assert one_call.allreduce_ms(three.layer("b"), 4) == pytest.approx(1e3 * NETWORK.allreduce_s(4, 8e6))
    assert one_call.group_rounds_ms(dict.fromkeys("abc", 4)) == {}, "each layer's call pays its own latency"


def test_every_rank_group_pays_its_own_all_reduce_latency_rounds():
    """A group's buckets are its own: a lone small layer on 4 ranks pays a whole all-reduce latency."""
    three = synthetic.graph([("a", ("x",), 8_000_000, 40_000), ("b", ("a",), 8_000_000, 40_000),
                             ("c", ("b",), 20_000, 40_000)])
    profile = synthetic.profile(three, {"a": 0.1, "b": 0.1, "c": 0.1}, 0.05, (1, 2, 4, 8, 16, 32))
    cost = CostModel(graph=three, profile=profile, network=NETWORK, global_batch=32, bucket_bytes=4_000_000)
    latency = 1e3 * NETWORK.allreduce_s(4, 0.0)
    assert cost.group_rounds_ms({"a": 2, "b": 2, "c": 4}) == {
        "a": pytest.approx(1e3 * NETWORK.allreduce_s(2, 0.0)), "c": pytest.approx(latency)}
    assert cost.group_rounds_ms({"a": 1, "b": 1, "c": 1}) == {}, "no group of one rank all-reduces"
    on_cpu = replace(cost, network=replace(NETWORK, allreduce_overlap=0.0))
    buckets = 16_020_000 / 4_000_000  # nothing hides behind the backward: one latency per bucket
    assert on_cpu.group_rounds_ms(dict.fromkeys("abc", 4)) == {"a": pytest.approx(buckets * latency)}
    assignment = {"a": 2, "b": 2, "c": 4}
    base = sum(cost.layer_ms(three.layer(n), g) for n, g in assignment.items()) + sum(
        cost.round_trip_ms(three.layer(u), assignment[u], assignment[v]) for u, v in three.edges())
    assert cost.iteration_ms(assignment) == pytest.approx(base + sum(cost.group_rounds_ms(assignment).values()))
    assert cost.schedule(assignment)[-1].end_ms == pytest.approx(cost.iteration_ms(assignment))


def test_the_reducer_copies_gradients_into_the_bucket_and_back_at_the_memory_bandwidth():
    """``CP_l = 4·W_l/BW_mem`` beside the all-reduce; a lone tensor under bucket 0 is reduced in place."""
    two = replace(synthetic.layer("a", ("x",), params=8_000_000, act=40_000), params=("a.weight", "a.bias"))
    graph = replace(GRAPH, layers=(two, GRAPH.layer("b")))
    cost = replace(_cost(bucket_bytes=0), graph=graph, network=replace(NETWORK, allreduce_overlap=0.0))
    copy = 1e3 * 4 * 8e6 / cost.profile.memory_bandwidth
    assert cost.bucket_copy_ms(two) == pytest.approx(copy)
    assert cost.allreduce_ms(two, 4) == pytest.approx(1e3 * NETWORK.allreduce_s(4, 8e6) + copy)
    assert cost.bucket_copy_ms(GRAPH.layer("a")) == 0, "one tensor, bucket 0: all-reduced in place"
    slower = replace(cost, profile=replace(cost.profile, memory_bandwidth=cost.profile.memory_bandwidth / 2))
    assert slower.bucket_copy_ms(two) == pytest.approx(2 * copy)
    assert cost.allreduce_ms(two, 1) == 0, "no all-reduce, no bucket, on one rank"


def test_synchronised_batchnorm_pays_three_small_allreduces():
    bn = replace(synthetic.layer("a", ("x",), params=512, act=4096), op="BatchNorm2d", output_shape=(64, 4, 4))
    graph = replace(GRAPH, layers=(bn, GRAPH.layer("b")))
    cost = replace(_cost(), graph=graph)
    forward = sum(NETWORK.allreduce_s(8, 8 * n) for n in (65, 64))
    assert cost.batchnorm_ms(bn, 8) == pytest.approx((1e3 * forward, 1e3 * NETWORK.allreduce_s(8, 8 * 128)))
    assert cost.batchnorm_ms(bn, 1) == (0, 0) and cost.batchnorm_ms(GRAPH.layer("b"), 8) == (0, 0)
    fwd, bwd = cost.compute_ms(bn, 8)
    assert cost.phases_ms(bn, 8) == pytest.approx((fwd + 1e3 * forward, bwd + 1e3 * NETWORK.allreduce_s(8, 1024)))


def test_reshard_is_priced_at_the_slowest_link_it_crosses():
    cost, a = _cost(), GRAPH.layer("a")
    inside = 1e3 * (1e-5 + 40_000 * math.ceil(32 / 2) / 100e9)
    across = 1e3 * (5e-5 + 40_000 * math.ceil(32 / 2) / NETWORK.inter_bandwidth)
    assert cost.reshard_ms(a, 2, 4) == pytest.approx(inside)
    assert cost.reshard_ms(a, 2, 8) == pytest.approx(across) == pytest.approx(cost.reshard_ms(a, 8, 2))
    assert cost.reshard_ms(a, 8, 8) == 0


def test_bytes_follow_the_precision():
    fp32, bf16 = _cost(), _cost(precision=Precision.BF16)
    a = GRAPH.layer("a")
    assert bf16.param_bytes(a) == fp32.param_bytes(a) / 2 and bf16.act_bytes(a) == fp32.act_bytes(a) / 2
    assert bf16.memory_bytes(a, 4) * 2 == pytest.approx(fp32.memory_bytes(a, 4), abs=2)


def test_a_network_faster_across_nodes_than_inside_is_refused():
    with pytest.raises(DeeppoolError, match="cross-node figures"):
        NETWORK.with_overrides(inter_gbps=200)


def test_optimizer_step_and_memory_follow_the_optimizer():
    sgd, adam = _cost(), _cost(optimizer=Optimizer.ADAM)
    a = GRAPH.layer("a")
    assert adam.step_ms(a) == pytest.approx(7 / 3 * sgd.step_ms(a))
    assert adam.memory_bytes(a, 4) - sgd.memory_bytes(a, 4) == 2 * 8_000_000
    assert sgd.iteration_ms({"a": 4, "b": 2}) == pytest.approx(
        sgd.layer_ms(a, 4) + sgd.layer_ms(GRAPH.layer("b"), 2) + 2 * sgd.reshard_ms(a, 4, 2) + sgd.rounds_ms(4, 8e6)
    )


def test_the_loss_and_the_optimizers_fixed_costs_are_priced_where_the_executor_pays_them():
    base = _cost()
    loss = LayerTimes(batches=(8, 16), fwd_ms=(0.2, 0.3), bwd_ms=(0.4, 0.5))
    overhead = {"sgd": StepOverhead(call_ms=0.25, per_tensor_ms=0.01)}
    cost = _cost(profile=replace(base.profile, loss=loss, step_overhead=overhead))
    a, b = GRAPH.layer("a"), GRAPH.layer("b")
    assert GRAPH.output == "b"
    assert cost.phases_ms(b, 2) == pytest.approx(tuple(x + y for x, y in zip(base.phases_ms(b, 2), (0.3, 0.5))))
    assert cost.phases_ms(a, 2) == base.phases_ms(a, 2), "only the output layer runs the loss"
    assert cost.step_ms(a) == pytest.approx(base.step_ms(a) + 0.01 * len(a.params))
    assignment = {"a": 4, "b": 2}
    assert cost.iteration_ms(assignment) == pytest.approx(
        base.iteration_ms(assignment) + 0.3 + 0.5 + 0.01 * len(a.params) + 0.25)
    phases = cost.schedule(assignment)
    assert phases[-1].end_ms == pytest.approx(cost.iteration_ms(assignment)), "the step's call ends the iteration"
    assert (phases[-1].ranks, phases[-1].end_ms - phases[-1].start_ms) == (4, pytest.approx(0.25))
    assert _cost(optimizer=Optimizer.ADAM, profile=cost.profile).step_call_ms == 0, "Adam's overhead not measured"


def test_a_step_after_a_backward_pays_its_measured_cost_per_megabyte_of_the_layers_parameters():
    base = _cost()
    overhead = {"sgd": StepOverhead(call_ms=0.25, per_tensor_ms=0.01, per_megabyte_ms=0.2)}
    cost = _cost(profile=replace(base.profile, step_overhead=overhead))
    a = GRAPH.layer("a")
    assert base.param_bytes(a) > 0
    assert cost.step_ms(a) == pytest.approx(base.step_ms(a) + 0.01 * len(a.params) + 0.2 * base.param_bytes(a) / 1e6)
    with pytest.raises(DeeppoolError, match="regenerate the profile"):
        StepOverhead(per_megabyte_ms=-0.1)


def test_compute_is_priced_at_the_precision_peak_and_the_plan_records_it():
    heavy = replace(synthetic.layer("a", ("x",), params=4, act=4), fwd_flops=1e12, bwd_flops=2e12)
    a100 = DEVICES[KnownDevice.A100]
    fp32, bf16 = (estimate_ms(heavy, 8, a100, p) for p in (Precision.FP32, Precision.BF16))
    assert fp32[0] / bf16[0] == pytest.approx(312 / 19.5, rel=1e-3)
    estimated = estimated_profile(GRAPH, a100, (1, 2, 4, 8), Precision.BF16)
    assert estimated.dtype == "bf16"
    planned = plan_graph(GRAPH, estimated, NETWORK, PlanRequest(gpus=4, global_batch=8), model=SPEC)
    assert planned.plan.precision is Precision.BF16 and planned.cost.precision is Precision.BF16
    assert Plan.from_json(planned.plan.to_json()).precision is Precision.BF16
