"""Plans made by hand for tests: an estimated profile and a chosen GPU count per layer."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from deeppool.model.graph import Layer, LayerGraph
from deeppool.model.loading import load_model
from deeppool.model.trace import trace
from deeppool.plans import ModelSpec, Plan, SolverInfo, Strategy
from deeppool.planner.hardware import DEVICES, NETWORKS, KnownDevice
from deeppool.planner.profiling.profile import estimated_profile
from deeppool.planner.solve.baselines import Baselines, tie
from deeppool.planner.solve.build import build_plan
from deeppool.planner.solve.cost import CostModel

MODELS = Path(__file__).resolve().parent / "models"

Assign = Callable[[int, Layer], int]


def model_path(name: str) -> str:
    return str(MODELS / f"{name}.py")


def make_plan(name: str, *, global_batch: int, gpus: int, assign: Assign) -> Plan:
    """A plan for ``tests/executor/models/<name>.py`` giving layer ``i`` ``assign(i, layer)`` GPUs."""
    return make_plan_for(model_path(name), global_batch=global_batch, gpus=gpus, assign=assign)


def make_plan_for(path: str | Path, *, global_batch: int, gpus: int, assign: Assign) -> Plan:
    """A plan for the model file at ``path`` giving layer ``i`` ``assign(i, layer)`` GPUs.

    Layers that share a parameter take the first one's count, as the planner requires.
    """
    spec = ModelSpec.parse(str(path))
    graph = traced_graph(spec.location)
    profile = estimated_profile(graph, DEVICES[KnownDevice.A100], (1, 2, 4, 8, 16, 32, 64))
    cost = CostModel(graph=graph, profile=profile, network=NETWORKS[KnownDevice.A100], global_batch=global_batch)
    assignment = tie(cost, {layer.name: assign(i, layer) for i, layer in enumerate(graph.layers)})
    return build_plan(
        cost, assignment, model=spec, gpus=gpus, strategy=Strategy.ILP, amplification_limit=None,
        solver=SolverInfo(name="hand", status="Optimal", seconds=0.0, gap=0.0),
        baselines=Baselines(data_parallel_ms=1.0, deeppool_ms=1.0, best_data_parallel_gpus=1, best_data_parallel_ms=1.0),
    )


@functools.cache
def traced_graph(location: str) -> LayerGraph:
    """The model file's layer graph, traced once per test session (a LayerGraph is immutable)."""
    return trace(load_model(ModelSpec.parse(location))).graph


def cycle(*counts: int) -> Assign:
    """Layer ``i`` gets ``counts[i % len(counts)]`` GPUs."""
    return lambda i, layer: counts[i % len(counts)]
