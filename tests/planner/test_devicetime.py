"""Device time per layer, the host's issue cost and a stage's time from both, through the fake GPU on CPU."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from deeppool.device.fake import FakeGpu
from deeppool.errors import DeeppoolError
from deeppool.model.layer_exec import runners
from deeppool.model.loading import load_model
from deeppool.model.trace import trace
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
from deeppool.plans import ModelSpec

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]
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
    """The measured profile's layers at the batch of the device times: the larger of device and host time,
    scaled to the batch's whole pass; at another batch, the measured time scaled as the nearest batch's."""
    events = {name: LayerTimes(batches=(4, 8), fwd_ms=(1.0, 2.0), bwd_ms=(2.0, 4.0)) for name in found}
    profile = Profile(device="fake-gpu", source="measured", dtype="float32", memory_bytes=2**30, layers=events,
                      whole_pass={4: WholePass(fwd_ms=3.0, bwd_ms=5.0, layer_fwd_ms=5.0, layer_bwd_ms=10.0)})
    host = HostCost(fwd_op_ms=0.2, bwd_op_ms=0.0, host="h", torch="t", device="fake-gpu")
    made = with_device_time(profile, {4: found}, host)
    larger = {n: max(c.device.fwd_ms, 0.2 * c.fwd_ops) for n, c in found.items() if c.device is not None}
    assert made.source == "measured+device-time"
    assert sum(made.times(n, 4)[0] for n in found) == pytest.approx(3.0)
    assert sum(made.times(n, 4)[1] for n in found) == pytest.approx(5.0)
    for n in found:
        assert made.times(n, 4)[0] == pytest.approx(3.0 * larger[n] / sum(larger.values()))
        assert made.times(n, 8)[0] == pytest.approx(2 * made.times(n, 4)[0])
    with pytest.raises(DeeppoolError, match="no device time for layer"):
        with_device_time(profile, {4: {**found, next(iter(found)): LayerCost(device=None, fwd_ops=1, bwd_ops=1)}}, host)


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
