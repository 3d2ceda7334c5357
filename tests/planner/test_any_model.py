"""Users' idioms, traced: in-place ops, structured outputs, keyword inputs, tied weights, shape-only values.

Each traced model is run layer by layer (as the executor does, one layer at a
time on its own inputs) and compared with the eager model; the end-to-end
runs on real ranks are in ``tests/test_zoo.py``.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

from deeppool.errors import DeeppoolError
from deeppool.executor.api import train_rank
from deeppool.executor.config import OptimizerConfig, RunConfig
from deeppool.model.batching import check_per_sample
from deeppool.model.graph import OUTPUT_LAYER
from deeppool.model.layer_exec import LayerRunner
from deeppool.model.loading import LoadedModel, bind_inputs, default_loss
from deeppool.model.trace import Traced, trace
from deeppool.plans import ModelSource, ModelSpec
from deeppool.planner.api import PlanRequest, device_setup, plan_graph
from tests.executor.fakes import SerialBuilder, ThreadWorld, run_threads
from tests.executor.plans import cycle, make_plan_for

Heads = namedtuple("Heads", ["logits", "aux"])


class InPlace(nn.Module):
    """In-place activation, ``+=`` residual, a mask filled in place after a read, ``x[:, 0] = 0``, shape reads."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> Heads:
        out = self.fc1(x)
        out += x
        out = self.act(out)
        big = out > 0.5
        out.masked_fill_(big, 0.0)
        b = out.size(0)
        logits = self.head(self.fc2(out.view(b, -1)) * scale)
        return Heads(logits=logits, aux=out.sum(dim=1, keepdim=True))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 16, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(0)).view(-1, 1, 1)  # a batch-sized value made from a size
        return self.out(self.mid(self.emb(tokens))) + 0 * positions


class Mixing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y - y.mean(dim=0, keepdim=True)


def loaded(module: nn.Module, make: Any) -> LoadedModel:
    return LoadedModel(module, make, lambda b: None, default_loss)


def layer_by_layer(traced: Traced, named: dict[str, Any]) -> Any:
    graph = traced.graph
    env = {name: named[key] for name, key in zip(graph.inputs, graph.input_keys, strict=True)}
    for layer in graph.layers:
        inputs = [env[name].detach().clone().requires_grad_(env[name].is_floating_point()) for name in layer.inputs]
        env[layer.name] = LayerRunner(traced.module, layer)(*inputs)
    return env[graph.output]


def test_in_place_ops_and_a_namedtuple_output_match_eager() -> None:
    torch.manual_seed(0)
    model = InPlace()
    spec = loaded(model, lambda b: {"x": torch.randn(b, 8, generator=torch.Generator().manual_seed(b))})
    traced = trace(spec)
    named = spec.named_inputs(5)
    got, want = layer_by_layer(traced, named), model(**named)
    assert isinstance(got, Heads)
    for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b)
    assert traced.graph.output == OUTPUT_LAYER
    assert traced.graph.input_keys == ("x",)


def test_tied_weights_count_once_and_get_one_gpu_count() -> None:
    spec = loaded(Tied(), lambda b: (torch.randint(0, 16, (b, 4), generator=torch.Generator().manual_seed(0)),))
    graph = trace(spec).graph
    (tied,) = graph.tied()
    assert {graph.layer(name).op for name in tied} == {"Embedding", "Linear"}
    assert sum(layer.param_bytes for layer in graph.layers) == sum(
        p.numel() * 4 for p in spec.module.parameters()
    )
    request = PlanRequest(gpus=8, global_batch=64)
    profile, network = device_setup("a100", 64, 8, graph)
    model = ModelSpec(source=ModelSource.FACTORY, location="tests.planner.test_any_model:Tied", input_shape=(4,))
    planned = plan_graph(graph, profile, network, request, model=model)
    for assignment in planned.assignments.values():
        assert len({assignment[name] for name in tied}) == 1
    assert "arange" not in graph.names  # made from a size: recomputed by its reader, never resharded


def test_keyword_inputs_constants_and_defaults_are_bound_by_name() -> None:
    model = InPlace()
    assert bind_inputs(model, (torch.ones(2, 8),)).keys() == {"x"}
    assert bind_inputs(model, {"x": torch.ones(2, 8), "scale": 2.0})["scale"] == 2.0
    with pytest.raises(DeeppoolError, match="does not fit InPlace.forward"):
        bind_inputs(model, {"y": torch.ones(2, 8)})


def test_the_default_loss_uses_the_models_own_or_every_floating_output() -> None:
    own = {"loss": torch.tensor(3.0), "logits": torch.ones(2, 2)}
    assert float(default_loss(own, None)) == 3.0
    assert float(default_loss(Heads(torch.ones(2, 2), 2 * torch.ones(2, 1)), None)) == 5.0


def test_a_model_that_mixes_samples_is_refused_naming_the_layer() -> None:
    spec = loaded(Mixing(), lambda b: (torch.randn(b, 4, generator=torch.Generator().manual_seed(1)),))
    with pytest.raises(DeeppoolError, match="mixes the samples of a batch"):
        check_per_sample(trace(spec), spec, seed=0)
    fine = loaded(InPlace(), lambda b: (torch.randn(b, 8, generator=torch.Generator().manual_seed(1)),))
    check_per_sample(trace(fine), fine, seed=0)


def test_a_burst_plan_with_dropout_in_place_ops_and_a_tied_head_trains_exactly() -> None:
    plan = make_plan_for("tests/models/zoo/attn_shapes.py", global_batch=5, gpus=2, assign=cycle(2, 1))
    builder = SerialBuilder(plan.gpus)
    config = RunConfig(steps=2, warmup=0, check=True, optimizer=OptimizerConfig(lr=0.05))
    results = run_threads(ThreadWorld(2), lambda comm: train_rank(plan, comm=comm, config=config, builder=builder))
    check = results[0].summary.check
    assert check is not None and check.passed, check
