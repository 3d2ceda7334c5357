"""Device time per layer, the host's issue cost and a stage's time from both, through the fake GPU on CPU."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from deeppool.device.fake import FakeGpu
from deeppool.errors import DeeppoolError
from deeppool.model.graph import LayerGraph
from deeppool.model.layer_exec import runners
from deeppool.model.loading import load_model
from deeppool.model.trace import trace
from deeppool.planner.api import plan_graph
from deeppool.planner.profiling.devicetime import (
    HostCost,
    LayerCost,
    host_cost,
    layer_device_times,
    measure_layers,
    replay_ms,
    stage_ms,
    with_device_time,
)
from deeppool.planner.profiling.passes import Passes
from deeppool.planner.profiling.profile import LayerTimes, Profile, WholePass
from deeppool.planner.profiling.profiler import ProfilerConfig, measure_profile
from deeppool.planner.request import PlanRequest
from deeppool.planner.solve.cost import CostModel, PhaseKind
from deeppool.plans import ModelSpec, NetworkModel, Strategy

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]
NETWORK = NetworkModel(gpus_per_node=4, intra_bandwidth=100e9, nics_per_node=4, nic_bandwidth=10e9,
                       intra_latency_s=1e-5, inter_latency_s=5e-5, allreduce_efficiency=0.5,
                       allreduce_latency_factor=2.0)
OP_MS = {"addmm.default": 0.4, "mm.default": 0.3, "relu.default": 0.05, "threshold_backward.default": 0.05}


def _modelled(name: str) -> float:
    return OP_MS.get(name, 0.01)


def test_the_stage_formula_on_cases_worked_by_hand() -> None:
    assert stage_ms([1, 1, 1], [0, 0, 0]) == 3  # host-bound: the issue time
    assert stage_ms([0, 0, 0], [2, 3, 4]) == 9  # device-bound: the device's work
    assert stage_ms([10, 0], [0, 10]) == 20  # the second layer is issued only after the first's long issue
    assert stage_ms([1, 1], [5, 5]) == 11  # the device starts after the first issue, then never waits
    assert stage_ms([], []) == 0
    with pytest.raises(DeeppoolError, match="one host and one device time"):
        stage_ms([1], [])


def test_the_stage_formula_is_what_the_device_timeline_gives_and_lies_between_its_bounds() -> None:
    """The executor's overlap, as the fake's device timeline runs it: the host issues each layer after its
    issue time (an injected clock), the device runs it for its modelled time once issued and once the layer
    before has run; the events around the stage measure the flow-shop makespan to the bit."""
    draw = random.Random(7)
    for _ in range(10):
        layers = draw.randint(1, 8)
        host = [draw.choice([0.0, 0.5, 1.0, 3.0]) for _ in range(layers)]
        device = [draw.choice([0.0, 0.25, 2.0, 4.0]) for _ in range(layers)]
        now, queue = [0.0], list(device)
        gpu = FakeGpu(clock=lambda now=now: now[0], op_ms=lambda name, queue=queue: queue.pop(0)
                      if name == "mm.default" else 0.0, sleep=lambda s, now=now: now.__setitem__(0, now[0] + s))
        left, right = torch.ones(2, 2), torch.ones(2, 2)
        with gpu.on(CPU):
            start, end = gpu.event(), gpu.event()
            start.record()
            for issue in host:
                now[0] += issue / 1e3
                torch.mm(left, right)
            end.record()
            end.synchronize()
        measured = start.elapsed_time(end)
        assert measured == pytest.approx(stage_ms(host, device), abs=1e-9)
        assert max(sum(host), sum(device)) - 1e-9 <= measured <= sum(host) + sum(device) + 1e-9
        per_layer = sum(max(h, d) for h, d in zip(host, device, strict=True))  # the device models' approximation
        assert measured - max(min(h, d) for h, d in zip(host, device, strict=True)) - 1e-9 <= per_layer <= 2 * measured


def test_a_captured_layer_replays_for_its_device_time_not_its_issue_time() -> None:
    gpu = FakeGpu(op_ms=_modelled)
    layer = torch.nn.Linear(16, 16)
    x = torch.randn(4, 16, requires_grad=True)
    with gpu.on(CPU):
        forward_ms = replay_ms(gpu, CPU, lambda: layer(x))
        times = layer_device_times(gpu, CPU, lambda: layer(x), lambda out: torch.autograd.grad(
            [out], [x, *layer.parameters()], [torch.ones(4, 16)]))
    assert forward_ms == pytest.approx(0.4 + 0.01)  # addmm and the weight's transpose
    assert times.captured and times.fwd_ms == pytest.approx(forward_ms)
    assert 2 * 0.3 < times.bwd_ms < 2 * 0.3 + 15 * 0.01  # two mm, and a few small ops: transposes, the bias's sum


def test_every_layer_of_a_model_is_captured_with_its_ops_counted() -> None:
    loaded = load_model(ModelSpec.parse(str(REPO / "examples" / "background_mlp.py")))
    traced = trace(loaded)
    graph = traced.graph
    passes = Passes(module=traced.module, graph=graph, runners=runners(traced.module, graph.layers), device=CPU)
    (name,) = graph.inputs
    gpu = FakeGpu(op_ms=_modelled)
    with gpu.on(CPU):
        found = measure_layers(passes, {name: loaded.named_inputs(4)[graph.input_keys[0]]}, 4, gpu, replays=3)
    assert list(found) == list(graph.names)
    assert all(cost.device is not None and cost.device.captured and cost.fwd_ops >= 1 for cost in found.values())
    linear = [layer.name for layer in graph.layers if layer.op == "Linear"]
    device = {n: cost.device for n, cost in found.items() if cost.device is not None}
    assert all(device[n].fwd_ms == pytest.approx(0.41) for n in linear)
    assert device[linear[0]].bwd_ms < device[linear[1]].bwd_ms  # the first Linear has no input's gradient
    assert all(found[n].bwd_ops > 0 for n in graph.names)
    counted = measure_layers(passes, {name: loaded.named_inputs(4)[graph.input_keys[0]]}, 4, None)
    assert {n: (c.fwd_ops, c.bwd_ops) for n, c in counted.items()} == \
        {n: (c.fwd_ops, c.bwd_ops) for n, c in found.items()}  # counted the same on the plain CPU
    _a_profile_takes_its_layer_times_from_device_time(found)


def _a_profile_takes_its_layer_times_from_device_time(found: dict[str, LayerCost]) -> None:
    """The measured profile's layers at the batch of the device times: the device times, the host's issue times
    beside them; at another batch, the measured time scaled as the nearest batch's, the host time the same."""
    events = {name: LayerTimes(batches=(4, 8), fwd_ms=(1.0, 2.0), bwd_ms=(2.0, 4.0)) for name in found}
    profile = Profile(device="fake-gpu", source="measured", dtype="float32", memory_bytes=2**30, layers=events,
                      whole_pass={4: WholePass(fwd_ms=3.0, bwd_ms=5.0, layer_fwd_ms=5.0, layer_bwd_ms=10.0)})
    host = HostCost(fwd_op_ms=0.2, bwd_op_ms=0.1, host="h", torch="t", device="fake-gpu")
    made = with_device_time(profile, {4: found}, host)
    assert made.source == "measured+device-time"
    for n, c in found.items():
        assert c.device is not None
        assert made.times(n, 4) == pytest.approx((c.device.fwd_ms, c.device.bwd_ms))
        assert made.times(n, 8) == pytest.approx((2 * c.device.fwd_ms, 2 * c.device.bwd_ms))
        assert made.host_times(n, 4) == made.host_times(n, 8) == pytest.approx((0.2 * c.fwd_ops, 0.1 * c.bwd_ops))
    assert Profile.from_json(made.to_json()) == made
    assert "host" not in profile.to_json()  # a profile without host times is written as before
    with pytest.raises(DeeppoolError, match="no device time for layer"):
        with_device_time(profile, {4: {**found, next(iter(found)): LayerCost(device=None, fwd_ops=1, bwd_ops=1)}}, host)


def test_a_profile_through_the_fake_gpu_carries_device_and_host_times_and_plans_stages_by_the_formula(
        tmp_path: Path) -> None:
    """The profiler with a GPU (the fake, its device times modelled) keeps each layer's device time and the host's
    issue time; a plan from it prices each stage by the stage formula, forward and backward, and its iteration
    is what its schedule adds up to."""
    spec = ModelSpec.parse(str(REPO / "examples" / "background_mlp.py"))
    loaded = load_model(spec)
    traced = trace(loaded)
    graph = traced.graph
    config = ProfilerConfig(batches=(4,), warmup=1, repeats=1, max_repeats=1, cache_dir=tmp_path,
                            show_progress=False, load=lambda: 0.0, spread_bound=1e9, reference=None,
                            gpu=FakeGpu(op_ms=_modelled), device_replays=2)
    profile = measure_profile(traced, loaded, config)
    (kept,) = tmp_path.glob("host-cost-*.json")
    host = HostCost.from_json(json.loads(kept.read_text()))
    assert profile.source == "measured+device-time" and set(profile.host) == set(graph.names)
    linear = [layer.name for layer in graph.layers if layer.op == "Linear"]
    assert all(profile.times(n, 4)[0] == pytest.approx(0.41) for n in linear)  # addmm and the weight's transpose
    for name in graph.names:  # the host's issue time: a whole number of ops at the host's cost per op
        issue = profile.host_times(name, 4)[0]
        assert issue > 0 and issue == pytest.approx(host.fwd_op_ms * round(issue / host.fwd_op_ms))
    names = list(graph.names)
    request = PlanRequest(gpus=1, global_batch=4, strategy=Strategy.DATA_PARALLEL)
    plan = plan_graph(graph, profile, NETWORK, request, model=spec).plan
    fwd = stage_ms([profile.host_times(n, 4)[0] for n in names], [profile.times(n, 4)[0] for n in names])
    bwd = stage_ms([profile.host_times(n, 4)[1] for n in reversed(names)],
                   [profile.times(n, 4)[1] for n in reversed(names)])
    loss_fwd, loss_bwd = profile.loss_times(4)
    assert sum(layer.fwd_ms for layer in plan.layers) == pytest.approx(fwd + loss_fwd)
    assert sum(layer.bwd_ms for layer in plan.layers) == pytest.approx(bwd + loss_bwd)
    steps = sum(layer.step_ms for layer in plan.layers) + plan.predicted.step_call_ms
    assert plan.predicted.iteration_ms == pytest.approx(fwd + bwd + loss_fwd + loss_bwd + steps)
    _two_stages_are_each_priced_by_the_formula(graph, profile)


def _two_stages_are_each_priced_by_the_formula(graph: LayerGraph, profile: Profile) -> None:
    names = list(graph.names)
    assignment = {name: 1 if index < 2 else 2 for index, name in enumerate(names)}
    cost = CostModel(graph=graph, profile=profile, network=NETWORK, global_batch=8)
    phases = cost.schedule(assignment)
    assert phases[-1].end_ms == pytest.approx(cost.iteration_ms(assignment))
    for stage, gpus in ((names[:2], 1), (names[2:], 2)):
        batch, share = 8 // gpus, profile.sharing(gpus)  # ranks sharing the fake's CPU: both times slowed alike
        forward = sum(p.end_ms - p.start_ms for p in phases if p.kind is PhaseKind.FORWARD and p.layer in stage)
        loss = profile.loss_times(batch)[0] if graph.output in stage else 0.0
        assert forward == pytest.approx(share * (loss + stage_ms([profile.host_times(n, batch)[0] for n in stage],
                                                                 [profile.times(n, batch)[0] for n in stage])))


def test_the_host_cost_is_measured_once_per_host_and_kept(tmp_path: Path) -> None:
    gpu = FakeGpu()
    with gpu.on(CPU):
        first = host_cost(tmp_path, gpu, CPU, "fake-gpu")
    assert first.fwd_op_ms > 0 and first.bwd_op_ms > 0 and first.torch == torch.__version__
    (kept,) = tmp_path.glob("host-cost-*fake-gpu.json")
    assert host_cost(tmp_path, None, CPU, "fake-gpu") == first  # read back, not measured again
    assert first.issue_ms(10, 20) == pytest.approx((10 * first.fwd_op_ms, 20 * first.bwd_op_ms))
    kept.write_text("{}")
    with pytest.raises(DeeppoolError, match="host cost file needs"):
        host_cost(tmp_path, None, CPU, "fake-gpu")
    with pytest.raises(DeeppoolError, match=">= 0"):
        HostCost(fwd_op_ms=-1, bwd_op_ms=0, host="h", torch="t", device="d")
