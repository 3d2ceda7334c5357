"""Tracing: fx first, torch.export as the fallback, a clear error when neither works."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from deeppool.errors import DeeppoolError
from deeppool.model.graph import Layer, LayerGraph, TraceMethod
from deeppool.model.layer_exec import runners
from deeppool.model.loading import LoadedModel, default_loss, load_model
from deeppool.model.trace import BranchWatch, check_branches, trace, trace_spec
from deeppool.plans import ModelSpec

MODELS = Path(__file__).resolve().parents[1] / "models"
ZOO = MODELS / "zoo"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CHANNELS_LAST = Path(__file__).resolve().parents[1] / "executor" / "models" / "channels_last.py"


class SizeGlue(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return (y + x) * x.size(1)


class ShapeLoop(nn.Module):
    """fx cannot iterate over a traced shape; torch.export can."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(x.shape[1] // 8):
            x = torch.relu(self.first(x))
        return self.second(x)


class Straight(torch.autograd.Function):
    """A straight-through estimator: ``round`` forward, the identity's gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class Rounded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Straight.apply(self.fc(x)) * 2


class RoundedLoop(ShapeLoop):
    """Only torch.export can trace it, and export traces through the Function."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Straight.apply(super().forward(x))


class Applies(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, fn) -> torch.Tensor:
        return fn(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class GivesAFunction(Rounded):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Applies.apply(self.fc(x), torch.round)


def _loaded(module: nn.Module) -> LoadedModel:
    return LoadedModel(module, lambda b: (torch.randn(b, 8),), lambda b: None, default_loss)


def _run_layers(traced, x: torch.Tensor) -> torch.Tensor:
    env = {traced.graph.inputs[0]: x}
    for name, runner in runners(traced.module, traced.graph.layers).items():
        env[name] = runner(*(env[i] for i in traced.graph.layer(name).inputs))
    return env[traced.graph.output]


def test_fx_layers_shapes_params_flops_and_glue():
    traced = trace(_loaded(SizeGlue()))
    graph = traced.graph
    assert graph.method is TraceMethod.FX
    assert graph.names == ("fc", "add", "mul")
    fc, add, mul = graph.layers
    assert fc.params == ("fc.weight", "fc.bias") and fc.param_bytes == (64 + 8) * 4
    assert fc.output_shape == (8,) and fc.act_bytes == 32
    assert fc.fwd_flops == 2 * 8 * 8 and fc.bwd_flops == 2 * fc.fwd_flops
    assert add.inputs == ("fc", "x")
    assert mul.nodes == ("size", "mul"), "the size() glue is recomputed by the layer that reads it"
    x = torch.randn(5, 8)
    torch.testing.assert_close(_run_layers(traced, x), traced.module(x))


def test_export_fallback_groups_nodes_by_module():
    module = ShapeLoop()
    traced = trace(_loaded(module))
    assert traced.graph.method is TraceMethod.EXPORT
    assert {layer.target for layer in traced.graph.layers} >= {"first", "second"}
    first = next(layer for layer in traced.graph.layers if layer.target == "second")
    assert first.op == "Linear" and first.param_bytes == (32 + 4) * 4
    x = torch.randn(3, 8)
    torch.testing.assert_close(_run_layers(traced, x), module(x))


def test_a_custom_autograd_function_is_one_layer_that_trains_with_its_own_backward():
    module = Rounded()
    traced = trace(_loaded(module))
    assert traced.graph.names == ("fc", "straight_apply", "mul")
    assert traced.graph.layer("straight_apply").op == "Straight_apply"
    x = torch.randn(5, 8, requires_grad=True)
    _run_layers(traced, x).sum().backward()
    torch.testing.assert_close(x.grad, 2 * module.fc.weight.sum(0).expand(5, 8).detach())  # round's own is 0
    assert vars(torch.autograd.Function)["apply"].__func__.__qualname__ == "Function.apply", "restored after"


def test_a_custom_autograd_function_only_export_can_trace_is_refused_naming_it():
    with pytest.raises(DeeppoolError, match=r"torch.export traces through the custom autograd Function 'Straight' "
                       r"at .*test_trace.py:\d+ .*Straight.apply\(super\(\).forward\(x\)\)"):
        trace(_loaded(RoundedLoop()))


def test_a_custom_autograd_function_given_what_fx_cannot_record_is_refused_naming_it():
    with pytest.raises(DeeppoolError, match=r"the autograd Function 'Applies' at .*test_trace.py:\d+ .* takes an "
                       r"argument torch.fx cannot record .*pass it tensors and constants only"):
        trace(_loaded(GivesAFunction()))


def test_export_fallback_on_the_meta_device():
    with torch.device("meta"):
        module = ShapeLoop()
    traced = trace(_loaded(module))
    assert traced.graph.method is TraceMethod.EXPORT
    assert traced.graph == trace(_loaded(ShapeLoop())).graph


def test_untraceable_model_names_the_module():
    loaded = load_model(ModelSpec.parse(str(MODELS / "untraceable.py")))
    with pytest.raises(DeeppoolError, match="torch.fx cannot trace module 'gate'.*torch.export cannot trace"):
        trace(loaded)


def test_branching_example_and_json_round_trip():
    traced = trace(load_model(ModelSpec.parse(str(EXAMPLES / "inception.py"))))
    graph = traced.graph
    cats = [layer for layer in graph.layers if layer.op == "cat"]
    assert cats and all(len(layer.inputs) == 4 for layer in cats)
    dag = graph.dag()
    assert dag.number_of_nodes() == len(graph) and max(d for _, d in dag.out_degree()) >= 4
    assert LayerGraph.from_json(graph.to_json()) == graph


def test_tracing_leaves_batchnorm_statistics_and_gradients_alone():
    module = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8))
    before = module[1].running_mean.clone()
    trace(_loaded(module))
    assert torch.equal(module[1].running_mean, before)
    assert all(param.grad is None for param in module.parameters())


class CountsSteps(nn.Module):
    """A buffer updated in forward from no sample (a step counter): torch.fx would run it eagerly, once."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return torch.relu(self.fc(x))


def test_buffer_update_that_reads_no_sample_runs_with_a_layer():
    module = CountsSteps()
    traced = trace(_loaded(module))
    assert int(module.steps) == 0, "tracing leaves the buffer as it was"
    assert traced.graph.method is TraceMethod.EXPORT, "fx would leave the update out of its graph"
    x = torch.randn(3, 8)
    torch.testing.assert_close(_run_layers(traced, x), torch.relu(module.fc(x)))
    assert int(module.steps) == 1, "running the layers updates the buffer once, as forward does"


def test_buffer_update_from_the_batch_is_refused_naming_it():
    with pytest.raises(DeeppoolError, match=r"buffer 'norm.mean' is updated in forward from the batch's values"):
        trace(load_model(ModelSpec.parse(str(ZOO / "refused" / "running_mean.py"))))


def test_random_branch_is_refused_naming_its_line():
    with pytest.raises(DeeppoolError, match=r"layerdrop.py:21 \(`if torch.rand\(\[\]\) < self.layerdrop:`\).*to 0"):
        trace(load_model(ModelSpec.parse(str(ZOO / "refused" / "layerdrop.py"))))


def test_a_model_the_meta_device_cannot_build_is_traced_on_cpu():
    spec = ModelSpec.parse(str(ZOO / "tv_regnet.py"))
    with pytest.raises(DeeppoolError, match="Cannot copy out of meta tensor"):
        load_model(spec, meta=True)
    loaded, traced = trace_spec(spec, meta=True)
    assert next(loaded.module.parameters()).device.type == "cpu"
    assert traced.graph == trace(load_model(spec)).graph, "the graph run traces"


def test_layerdrop_zero_is_specialised_listed_and_checked():
    spec = ModelSpec.parse(str(ZOO / "layerdrop_zero.py"))
    loaded = load_model(spec)
    graph = trace(loaded).graph
    assert graph.method is TraceMethod.FX
    assert [(Path(b.file).name, b.line, b.taken) for b in graph.branches] == [("layerdrop_zero.py", 27, False)] * 3
    assert {(Path(d.file).name, d.line) for d in graph.draws} == {("layerdrop_zero.py", 26)}
    assert LayerGraph.from_json(graph.to_json()) == graph
    x = loaded.named_inputs(4)["x"]
    with BranchWatch(apart=graph.draws) as watch:
        loaded.module(x)
    check_branches(graph.branches, watch.branches)
    loaded.module.encoder.layerdrop = 1.0  # every layer skipped now: the branch goes the other way
    with BranchWatch(apart=graph.draws) as watch:
        loaded.module(x)
    with pytest.raises(DeeppoolError, match=r"layerdrop_zero.py:27 \(`if dropout_probability < self.layerdrop"):
        check_branches(graph.branches, watch.branches)


def test_outputs_the_model_computes_channels_last_are_marked_so_reshards_keep_them() -> None:
    """A permute back to NCHW and the convolution and activation after it are channels-last; the rest not."""
    graph = trace(load_model(ModelSpec.parse(str(CHANNELS_LAST)))).graph
    assert {layer.name for layer in graph.layers if layer.channels_last} == {"permute_1", "depthwise", "relu"}
    assert Layer.from_json(graph.layer("depthwise").to_json()).channels_last
