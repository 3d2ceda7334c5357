"""Measured profiles: a few batches timed until stable, fitted, cached as they go; CUDA-timed on a GPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import deeppool
from deeppool.errors import DeeppoolError
from deeppool.model.graph import TraceMethod
from deeppool.model.layer_exec import CompiledLayerRunner, LayerFailed, LayerRunner, runners
from deeppool.model.loading import load_model
from deeppool.model.syncbn import GroupBatchNorm
from deeppool.model.trace import trace
from deeppool.plans import ModelSpec, Precision
from deeppool.planner.hardware import DEVICES, NETWORKS, KnownDevice
from deeppool.planner.profiling import group_times
from deeppool.planner.profiling.cache import ProfileCache, layer_code
from deeppool.planner.profiling.fitting import fit_layer, fit_line
from deeppool.planner.profiling.group_times import GroupedLayers
from deeppool.planner.profiling.passes import Passes
from deeppool.planner.profiling.profile import LayerTimes, Profile, StepOverhead, estimate_ms
from deeppool.planner.profiling.profiler import LayerProfiler, ProfilerConfig, measure_profile
from deeppool.planner.profiling.sharing import measure_sharing, sharing_counts
from deeppool.planner.profiling.stats import Measured
from deeppool.planner.profiling.step import measure_model_step
from deeppool.planner.solve.cost import CostModel, check_invariants
from tests.planner import synthetic

TINY = Path(__file__).resolve().parents[1] / "models" / "tiny_mlp.py"


def test_measure_then_cache_round_trip(tmp_path):
    loaded = load_model(ModelSpec.parse(str(TINY)))
    traced = trace(loaded)
    # every measurement trusted (a quiet machine, no spread counted as noisy): a noisy one would be measured again
    config = ProfilerConfig(batches=(1, 4), warmup=1, repeats=3, cache_dir=tmp_path, show_progress=False,
                            load=lambda: 0.0, spread_bound=1e9, reference=lambda: 10.0)
    first = measure_profile(traced, loaded, config)
    assert set(first.layers) == set(traced.graph.names)
    assert all(len(t.fwd_ms) == 2 and min(t.fwd_ms) > 0 for t in first.layers.values())
    assert first.layers["fc1"].bwd_ms[0] > 0
    assert len(ProfileCache(tmp_path).entries) == 2 * (len(traced.graph) + 2), \
        "every layer, the whole pass and the loss, per batch"
    assert first.loss is not None and first.loss.batches == (1, 4) and min(first.loss.fwd_ms) > 0
    assert min(first.loss.bwd_ms) > 0, "the loss's backward is timed"
    assert set(first.step_overhead) == {"sgd", "adam"}
    assert all(o.call_ms > 0 and o.per_tensor_ms > 0 for o in first.step_overhead.values())
    assert all(o.per_megabyte_ms >= 0 for o in first.step_overhead.values())
    again = measure_profile(traced, loaded, config)
    assert again.layers == first.layers, "a second profile of the same layers comes from the cache"
    assert again.whole_pass == first.whole_pass and set(first.whole_pass) == {1, 4}
    assert again.loss == first.loss
    assert first.memory_bandwidth > 1e8
    assert first.concurrent_ranks == max(1, (os.cpu_count() or 1) // torch.get_num_threads())
    path = tmp_path / "profile.json"
    first.save(path)
    assert Profile.load(path) == first


def test_the_models_own_step_after_a_backward_is_priced_per_megabyte_and_leaves_the_weights_as_they_were():
    loaded = load_model(ModelSpec.parse(str(TINY)))
    traced = trace(loaded)
    profiler = LayerProfiler(traced, loaded, ProfilerConfig(batches=(4,), show_progress=False))
    weights = {name: param.detach().clone() for name, param in traced.module.named_parameters()}
    named = loaded.named_inputs(4)
    inputs = {name: named[key] for name, key in zip(traced.graph.inputs, traced.graph.input_keys, strict=True)}
    tiny = {"sgd": StepOverhead(call_ms=0.01, per_tensor_ms=0.001)}
    found = measure_model_step(profiler.passes, inputs, 4, tiny, bandwidth=1e15, repeats=3, warmup=1)
    assert set(found) == {"sgd", "adam"}
    assert found["sgd"].call_ms == 0.01 and found["sgd"].per_tensor_ms == 0.001, "the tiny tensors' figures stay"
    assert all(o.per_megabyte_ms > 0 for o in found.values()), "a step at an endless bandwidth still takes time"
    assert all(torch.equal(param, weights[name]) for name, param in traced.module.named_parameters())
    assert all(param.grad is None for param in traced.module.parameters())


def test_every_timed_backward_writes_fresh_gradients_as_the_executor_does():
    """The executor steps with ``zero_grad(set_to_none=True)``: no backward accumulates into an old gradient."""
    loaded = load_model(ModelSpec.parse(str(TINY)))
    traced = trace(loaded)
    weight = traced.module.get_parameter(traced.graph.layer("fc1").params[0])
    found: list[bool] = []
    weight.register_hook(lambda grad: found.append(weight.grad is None))
    config = ProfilerConfig(batches=(2,), warmup=2, repeats=3, show_progress=False)
    measure_profile(traced, loaded, config)
    assert len(found) >= 5 and all(found), "a run found the previous run's gradient in place"


def test_a_profiling_pass_trains_layer_by_layer_as_the_whole_model_would():
    """Layers are timed in context: a pass runs every forward, then every backward with the gradient its
    consumers sent (the residual's two summed), from the model's input (which takes no gradient)."""
    loaded = load_model(ModelSpec.parse(str(TINY)))
    traced = trace(loaded)
    graph = traced.graph
    passes = Passes(module=traced.module, graph=graph, device=torch.device("cpu"),
                    runners={layer.name: LayerRunner(traced.module, layer) for layer in graph.layers})
    x = loaded.inputs(4)[0]
    fwd, bwd, values = passes.run(dict(zip(graph.inputs, (x,), strict=True)), batch=4, keep=frozenset({graph.output}))
    assert set(fwd) == set(bwd) == set(graph.names) and min(fwd.values()) > 0
    assert bwd[graph.layers[0].name] > 0, "the first layer's weight gradient is computed"
    by_pass = {name: p.grad.clone() for name, p in traced.module.named_parameters()}
    traced.module.zero_grad(set_to_none=True)
    reference = loaded.module(x)
    reference.backward(torch.ones_like(reference))
    for name, param in loaded.module.named_parameters():
        assert torch.allclose(by_pass[name], param.grad, atol=1e-6), name
    assert torch.equal(values[graph.output], reference.detach())


class _PairwiseGrad(torch.autograd.Function):
    """A hand-written backward that needs two samples (the forward runs at any batch)."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        if grad.shape[0] < 2:
            raise ValueError("the pairwise gradient needs at least two samples")
        return grad * 2


class _PairwiseRunner(LayerRunner):
    def __call__(self, *args):  # noqa: ANN002, ANN204
        return _PairwiseGrad.apply(super().__call__(*args))


@pytest.mark.parametrize("batch", [1, 2])
def test_a_layer_whose_backward_fails_at_a_batch_is_named_not_a_traceback(batch):
    loaded = load_model(ModelSpec.parse(str(TINY)))
    traced = trace(loaded)
    graph = traced.graph
    first = graph.layers[0]
    runners = {layer.name: LayerRunner(traced.module, layer) for layer in graph.layers}
    runners[first.name] = _PairwiseRunner(traced.module, first)
    passes = Passes(module=traced.module, graph=graph, device=torch.device("cpu"), runners=runners)
    inputs = dict(zip(graph.inputs, loaded.inputs(batch), strict=True))
    if batch >= 2:
        fwd, bwd, _ = passes.run(inputs, batch=batch)
        assert bwd[first.name] > 0
        return
    with pytest.raises(LayerFailed) as failed:
        passes.run(inputs, batch=batch)
    message = str(failed.value)
    assert message.startswith(f"layer '{first.name}'") and "at per-GPU batch 1" in message, message
    assert "ValueError: the pairwise gradient needs at least two samples" in message and "\n" not in message


def test_a_cpu_profile_knows_how_many_ranks_its_cores_hold(tmp_path):
    loaded = load_model(ModelSpec.parse(str(TINY)))
    config = ProfilerConfig(batches=(2,), warmup=0, repeats=1, threads=1, show_progress=False)
    profile = measure_profile(trace(loaded), loaded, config)
    cores = os.cpu_count() or 1
    assert profile.concurrent_ranks == cores
    assert profile.sharing(cores) == 1.0 and profile.sharing(2 * cores) == 2.0
    ranked = measure_profile(trace(loaded), loaded, replace(config, ranks=2))
    assert set(ranked.measured_sharing) == {2} and ranked.sharing(2) == ranked.measured_sharing[2]


@pytest.mark.parametrize("readings", [({2: 1.33}, {2: 1.02}), ({2: 1.02}, {2: 1.33})], ids=["slow-first", "slow-last"])
def test_the_cores_sharing_is_measured_before_and_after_the_layers_and_the_lower_kept(monkeypatch, readings):
    """A slow stretch through one measurement of the sharing only adds to it: the plan prices its stages by the
    other."""
    calls = iter(readings)
    monkeypatch.setattr("deeppool.planner.profiling.sharing.measure_sharing", lambda counts, threads: dict(next(calls)))
    loaded = load_model(ModelSpec.parse(str(TINY)))
    config = ProfilerConfig(batches=(2,), warmup=0, repeats=1, threads=1, ranks=2, show_progress=False)
    profile = measure_profile(trace(loaded), loaded, config)
    assert profile.measured_sharing == {2: 1.02}
    assert next(calls, None) is None, "measured twice"


def test_measured_core_sharing_is_interpolated_then_extrapolated_by_time_slicing(tmp_path):
    base = synthetic.profile(synthetic.graph([("a", ("x",), 4, 4)]), {"a": 1.0}, 0.0, (1, 2))
    measured = replace(base, concurrent_ranks=2, measured_sharing={2: 1.2, 4: 2.6})
    assert measured.sharing(1) == 1.0 and measured.sharing(2) == 1.2
    assert measured.sharing(3) == pytest.approx(1.9) and measured.sharing(8) == pytest.approx(5.2)
    assert replace(measured, measured_sharing={}).sharing(4) == 2.0, "not measured: cores over threads"
    path = tmp_path / "profile.json"
    measured.save(path)
    assert Profile.load(path) == measured
    with pytest.raises(DeeppoolError, match="measured_sharing"):
        Profile.from_json({**measured.to_json(), "measured_sharing": {"1": 1.0}})


def test_the_profiler_measures_how_ranks_share_the_cores():
    cores = os.cpu_count() or 1
    assert sharing_counts(None) == sharing_counts(1) == ()
    assert sharing_counts(4) == tuple(sorted({2, 4} & set(range(2, 2 * cores + 1))) or (min(4, 2 * cores),))
    assert max(sharing_counts(1000)) == 2 * cores
    measured = measure_sharing((2, 2 * cores), 1, repeats=1, matmuls=60)
    assert set(measured) == {2, 2 * cores} and all(value > 0 for value in measured.values())
    assert measured[2 * cores] > 1.2, "twice as many workers as cores cannot run at full speed"


def test_interpolation_between_and_beyond_measured_batches():
    profile = Profile.from_json({
        "artifact": "profile", "schema_version": 1, "device": "d", "source": "test", "dtype": "float32",
        "memory_bytes": 1, "memory_bandwidth": 1e9, "layers": {"a": {"batches": [2, 4], "fwd_ms": [1.0, 2.0], "bwd_ms": [2.0, 4.0]}},
    })
    assert profile.times("a", 3) == (1.5, 3.0)
    assert profile.times("a", 8) == (4.0, 8.0)
    assert profile.times("a", 1) == (0.5, 1.0)


def test_device_model_estimates_scale_with_the_device():
    graph = trace(load_model(ModelSpec.parse(str(TINY)))).graph
    fc1 = graph.layer("fc1")
    v100, h100 = (estimate_ms(fc1, 4096, DEVICES[k], Precision.TF32) for k in (KnownDevice.V100, KnownDevice.H100))
    assert h100[0] < v100[0] and h100[1] < v100[1]
    assert graph.method is TraceMethod.FX


def test_python_api_plans_a_module():
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    plan = deeppool.plan(model, (torch.randn(32, 16),), gpus=8, device_model="a100")
    assert plan.global_batch == 32 and len(plan.layers) == 3
    assert plan.predicted.iteration_ms <= plan.predicted.data_parallel_iteration_ms + 1e-9


def _cuda_config() -> ProfilerConfig:
    return ProfilerConfig(device="cuda", batches=(1, 64), warmup=2, repeats=5, show_progress=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_a_cuda_profile_without_a_gpu_is_refused_in_one_line():
    """The GPU test below, up to the device: its config is refused here, naming the way out."""
    with pytest.raises(DeeppoolError, match="no CUDA device here; use --device cpu or a device model"):
        _cuda_config()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_profile_uses_cuda_events(tmp_path):
    loaded = load_model(ModelSpec.parse(str(TINY)))
    measured = measure_profile(trace(loaded), loaded, _cuda_config())
    assert not measured.device.startswith("cpu")
    assert measured.source == "measured+device-time" and set(measured.host) == set(measured.layers)
    assert all(min(t.fwd_ms) >= 0 for t in measured.layers.values())  # device time: a view may launch nothing
    assert sum(t.fwd_ms[0] for t in measured.host.values()) > 0  # the host issues the layers' ops


def test_the_fit_is_a_nonnegative_line_that_keeps_gpu_time_from_shrinking():
    assert fit_line((2, 4, 8), [2.0, 3.0, 5.0]) == pytest.approx((1.0, 0.5))
    assert fit_line((2, 4, 8), [5.0, 1.0, 1.0])[1] == 0.0  # a falling time is noise: flat
    assert fit_line((2, 4, 8), [0.1, 4.0, 8.0])[0] == 0.0  # no negative intercept
    assert fit_line((4,), [2.0]) == (0.0, 0.5)
    samples = [Measured(fwd_ms=t, bwd_ms=2 * t, spread=0.0) for t in (2.0, 40.0, 5.0)]  # an outlier at 4
    times, errors = fit_layer((2, 4, 8), samples, (1, 2, 4, 8, 64, 128))
    for g in (2, 4, 8, 64):
        per_gpu = sum(times.at(128 // g))
        assert g * per_gpu >= sum(times.at(128)) - 1e-9, "a layer on g GPUs never costs less GPU-time than on one"
    assert max(errors) > 0.5


def test_measurements_repeat_until_stable_and_the_cache_is_written_as_it_goes(tmp_path):
    loaded = load_model(ModelSpec.parse(str(TINY)))
    traced = trace(loaded)
    ticks = iter(range(10_000))
    cache = ProfileCache(tmp_path, every_s=1.0, clock=lambda: float(next(ticks)))
    cache.put("k", Measured(fwd_ms=1.0, bwd_ms=2.0, spread=0.1))
    assert ProfileCache(tmp_path).get("k") == Measured(fwd_ms=1.0, bwd_ms=2.0, spread=0.1), "saved before the end"
    config = ProfilerConfig(batches=(1, 2), fit_to=(1, 2, 3, 16), warmup=1, repeats=2, max_repeats=6,
                            spread_bound=1e-6, show_progress=False)
    profile = measure_profile(traced, loaded, config)
    assert profile.fit is not None and profile.fit.measured_batches == (1, 2)
    assert profile.fit.measurements == 2 * len(traced.graph)
    assert profile.fit.noisy > 0  # few CPU timings are steady to a millionth
    assert profile.layers["fc1"].batches == (1, 2, 3, 16)
    assert "warning" in profile.fit.describe()
    assert Profile.from_json(profile.to_json()) == profile


def test_a_plan_whose_figures_break_the_invariants_is_refused():
    graph = synthetic.graph([("a", ("x",), 4_000, 4_000), ("b", ("a",), 0, 4_000)])
    broken = synthetic.profile(graph, {"a": 0.1, "b": 0.1}, 0.0, (1, 2, 4))
    broken.layers["a"] = LayerTimes(batches=(1, 2, 4), fwd_ms=(1.0, 50.0, 100.0), bwd_ms=(1.0, 1.0, 1.0))
    cost = CostModel(graph=graph, profile=broken, network=NETWORKS[KnownDevice.A100], global_batch=4)
    check_invariants(cost, {"a": 1, "b": 1})
    with pytest.raises(DeeppoolError, match="layer 'a' on 4 GPUs would use .* its one-GPU GPU-time"):
        check_invariants(cost, {"a": 4, "b": 4})



POOLED_BATCHNORM = Path(__file__).resolve().parents[1] / "models" / "pooled_batchnorm.py"


def test_a_batch_normalising_layer_is_also_timed_as_it_runs_on_several_ranks(tmp_path):
    """On ``g > 1`` ranks the executor runs BatchNorm synchronised (GroupBatchNorm), not the fused kernel: the
    profile times the layer that way too, the cost model prices it so on several ranks (and fused on one),
    and the profile's file keeps it."""
    loaded = load_model(ModelSpec.parse(str(POOLED_BATCHNORM)))
    traced = trace(loaded)
    profile = measure_profile(traced, loaded, ProfilerConfig(batches=(2, 4), warmup=1, repeats=3, show_progress=False))
    norm = next(layer for layer in traced.graph.layers if "BatchNorm" in layer.op)
    assert set(profile.grouped) == {norm.name}, "only the layer that normalises the batch runs differently"
    assert profile.grouped[norm.name].batches == profile.layers[norm.name].batches == (2, 4)
    assert profile.times(norm.name, 4, grouped=True) == profile.grouped[norm.name].at(4) != profile.times(norm.name, 4)
    other = next(layer.name for layer in traced.graph.layers if layer.name != norm.name)
    assert profile.times(other, 4, grouped=True) == profile.times(other, 4)
    cost = CostModel(graph=traced.graph, profile=profile, network=NETWORKS[KnownDevice.A100], global_batch=8)
    assert cost.compute_ms(norm, 2) == pytest.approx(tuple(t * profile.sharing(2) for t in profile.grouped[norm.name].at(4)))
    assert cost.compute_ms(norm, 1) == pytest.approx(profile.layers[norm.name].at(8))
    path = tmp_path / "profile.json"
    profile.save(path)
    assert Profile.load(path) == profile


def test_the_grouped_layer_timed_is_the_executors_and_leaves_the_model_alone():
    """The grouped runner swaps in the executor's GroupBatchNorm on a copy: same output as the fused layer
    (its sum over one rank is the identity), and the profiled model keeps its nn.BatchNorm."""
    loaded = load_model(ModelSpec.parse(str(POOLED_BATCHNORM)))
    traced = trace(loaded)
    layers = GroupedLayers.of(traced.module, traced.graph, runners(traced.module, traced.graph.layers))
    (name,) = layers.grouped
    x = torch.randn(4, 8, 1, 1, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(layers.grouped[name](x), layers.runners[name](x), rtol=1e-5, atol=1e-6)
    assert any(isinstance(m, GroupBatchNorm) for m in layers.module.modules())
    assert isinstance(traced.module.get_submodule("norm"), torch.nn.BatchNorm2d)


def test_the_profiler_runs_each_layer_as_generated_code_computing_what_interpreting_it_does():
    """The profiler's runners are compiled, as the executor's stages are (interpreting a node costs tens of
    microseconds the executor never pays); every layer's value is the interpreted one's."""
    for path in (TINY, POOLED_BATCHNORM):
        loaded = load_model(ModelSpec.parse(str(path)))
        traced = trace(loaded)
        graph = traced.graph
        profiler = LayerProfiler(traced, loaded, ProfilerConfig(batches=(4,), show_progress=False))
        assert all(isinstance(r, CompiledLayerRunner) for r in profiler.passes.runners.values())
        named = loaded.named_inputs(4)
        values = {name: named[key] for name, key in zip(graph.inputs, graph.input_keys, strict=True)}
        with torch.no_grad():
            for layer in graph.layers:
                args = [values[name] for name in layer.inputs]
                values[layer.name] = profiler.passes.runners[layer.name](*args)
                assert torch.equal(values[layer.name], LayerRunner(traced.module, layer)(*args)), layer.name


DROPOUT_MODEL = '''
import torch
from torch import nn


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.ReLU(), nn.Linear(16, 4), nn.Dropout(0.1))


def inputs(batch_size):
    return (torch.randn(batch_size, 8, generator=torch.Generator().manual_seed(0)),)
'''


def test_a_model_that_draws_random_numbers_is_timed_drawing_them_as_the_executor_does(tmp_path):
    """The executor runs a forward that draws random numbers under its per-sample randomness mode (every op
    passes through it, each random op draws sample by sample: BERT's forward took twice as long); the profiler
    times the forwards under the same mode."""
    path = tmp_path / "dropped.py"
    path.write_text(DROPOUT_MODEL)
    loaded = load_model(ModelSpec.parse(str(path)))
    traced = trace(loaded)
    profiler = LayerProfiler(traced, loaded, ProfilerConfig(batches=(4,), show_progress=False))
    mode = profiler.passes.random
    assert mode is not None and traced.random
    graph = traced.graph
    named = loaded.named_inputs(4)
    profiler.passes.run({n: named[k] for n, k in zip(graph.inputs, graph.input_keys, strict=True)}, batch=4)
    assert mode.ordinal == max(traced.random.first.values()) + 1, "the last random op drew through the mode"


def test_layer_times_add_up_to_the_whole_pass_they_were_scaled_to():
    """Each batch's layer times are scaled by the whole pass over their per-layer sum: the measured times add
    up to it (the profile then fits layers below the timer's noise floor, as it does any measurement)."""
    loaded = load_model(ModelSpec.parse(str(TINY)))
    traced = trace(loaded)
    profiler = LayerProfiler(traced, loaded, ProfilerConfig(batches=(2, 8), warmup=1, repeats=3, show_progress=False))
    profiler.measure((2, 8))
    profile = profiler.profile()
    for batch, whole in profile.whole_pass.items():
        fwd = sum(profiler.measured[name][batch].fwd_ms for name in traced.graph.names)
        bwd = sum(profiler.measured[name][batch].bwd_ms for name in traced.graph.names)
        assert whole.fwd_ms > 0 and whole.bwd_ms > 0 and whole.layer_fwd_ms > 0 and whole.layer_bwd_ms > 0
        assert fwd == pytest.approx(whole.fwd_ms, rel=1e-9) and bwd == pytest.approx(whole.bwd_ms, rel=1e-9)
    assert set(profile.whole_pass) == {2, 8}


def test_the_whole_pass_computes_what_the_layer_passes_do():
    """Chained forwards and one backward give the parameters the gradients the per-layer passes give."""
    loaded = load_model(ModelSpec.parse(str(TINY)))
    traced = trace(loaded)
    graph = traced.graph
    passes = Passes(module=traced.module, graph=graph, runners=runners(traced.module, graph.layers),
                    device=torch.device("cpu"))
    named = loaded.named_inputs(4)
    inputs = {name: named[key] for name, key in zip(graph.inputs, graph.input_keys, strict=True)}
    passes.run(inputs, batch=4)
    layered = {name: p.grad.clone() for name, p in traced.module.named_parameters()}
    fwd_ms, bwd_ms = passes.whole(inputs, batch=4)
    assert fwd_ms > 0 and bwd_ms > 0
    for name, param in traced.module.named_parameters():
        torch.testing.assert_close(param.grad, layered[name])


ALIKE_BATCHNORMS = '''
import torch
from torch import nn


class Alike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.conv3 = nn.Conv2d(8, 16, 3, padding=1)
        self.bn1, self.bn2, self.bn3 = nn.BatchNorm2d(8), nn.BatchNorm2d(8), nn.BatchNorm2d(16)

    def forward(self, x):
        return self.bn3(self.conv3(self.bn2(self.conv2(self.bn1(self.conv1(x)))))).mean(dim=(1, 2, 3))


def model():
    torch.manual_seed(0)
    return Alike()


def inputs(batch_size):
    return (torch.randn(batch_size, 3, 6, 6, generator=torch.Generator().manual_seed(0)),)
'''


def test_batchnorm_layers_alike_in_code_and_shapes_share_one_grouped_measurement(tmp_path):
    """bn1 and bn2 run the same code on arguments of the same shape: one grouped-over-fused measurement serves
    both; bn3 (16 channels) is measured on its own. Each measurement is two runners' timed repeats."""
    path = tmp_path / "alike.py"
    path.write_text(ALIKE_BATCHNORMS)
    loaded = load_model(ModelSpec.parse(str(path)))
    traced = trace(loaded)
    profiler = LayerProfiler(traced, loaded, ProfilerConfig(batches=(4,), show_progress=False))
    norms = {layer.name for layer in traced.graph.layers if "BatchNorm" in layer.op}
    assert norms == {"bn1", "bn2", "bn3"}
    timed: list[float] = []

    def timer(work):
        timed.append(1.0)
        return 1.0, work()

    named = loaded.named_inputs(4)
    inputs = {name: named[key] for name, key in zip(traced.graph.inputs, traced.graph.input_keys, strict=True)}
    code = {layer.name: layer_code(traced.module, layer, by_path=False)
            for layer in traced.graph.layers}
    ratios = GroupedLayers.of(traced.module, traced.graph, profiler.passes.runners).ratios(inputs, 4, timer, code)
    assert set(ratios) == norms
    assert code["bn1"] == code["bn2"] != code["bn3"]
    per_measurement = 2 * 2 * (group_times.REPEATS + 1)  # fused and grouped, forward and backward
    assert len(timed) == 2 * per_measurement, "bn1 and bn2 measured once between them, bn3 once"
    by_path = {name: layer_code(traced.module, traced.graph.layer(name)) for name in norms}
    assert len(set(by_path.values())) == 3, "the cache's digest still tells every layer apart"


_SHARING_CHILD = """
import sys
from deeppool.planner.profiling.sharing import measure_sharing
print("ready", flush=True)
try:
    measure_sharing((2, 4), 1)
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    sys.exit(130)
"""


@pytest.mark.slow
@pytest.mark.parametrize("after_s", [0.1, 0.3])
def test_ctrl_c_while_the_cores_sharing_is_measured_exits_cleanly(after_s):
    """Its worker threads are stopped and waited for: one still computing at exit aborted the interpreter."""
    child = subprocess.Popen([sys.executable, "-c", _SHARING_CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True)
    assert child.stdout is not None and child.stdout.readline().strip() == b"ready"
    time.sleep(after_s)
    os.killpg(child.pid, signal.SIGINT)
    _, stderr = child.communicate(timeout=60)
    assert (child.returncode, stderr.decode().strip().splitlines()) == (130, ["interrupted"])
