"""The planning pipeline: a traced graph and a profile in, a Plan out.

:func:`plan_graph` is what the CLI, the coordinator and the simulator call:
it builds the cost model, computes the two baselines and the ILP optimum in
the same run, and writes the plan of the chosen strategy. :func:`plan` is the
Python entry point for an ``nn.Module`` and example inputs.
"""

from __future__ import annotations

import importlib
import operator
import os
from dataclasses import dataclass

import torch
from torch import nn

from deeppool.planner import baselines
from deeppool.planner.batching import check_per_sample
from deeppool.planner.candidates import Limits, allowed_counts, check_memory, thinned_counts, useful_counts
from deeppool.planner.cost import CostModel
from deeppool.planner.graph import LayerGraph
from deeppool.planner.hardware import DEVICES, NETWORKS, NetworkModel, known_device
from deeppool.planner.ilp import solve
from deeppool.planner.modelspec import LoadedModel, ModelSource, ModelSpec, default_loss
from deeppool.planner.plan import Plan, SolverInfo, Strategy, build_plan
from deeppool.planner.profile import Profile, estimated_profile
from deeppool.planner.profiler import ProfilerConfig, measure_profile
from deeppool.planner.request import LOCAL, CostSource, PlanRequest, check_samples
from deeppool.planner.trace import Traced, trace

__all__ = ["LOCAL", "CostSource", "PlanRequest", "Planned", "device_setup", "plan", "plan_graph", "plan_model"]


@dataclass(frozen=True, kw_only=True)
class Planned:
    """The written plan and the assignments of every strategy, costed alike."""

    plan: Plan
    assignments: dict[Strategy, dict[str, int]]
    cost: CostModel


def plan_graph(
    graph: LayerGraph,
    profile: Profile,
    network: NetworkModel,
    request: PlanRequest,
    *,
    model: ModelSpec,
) -> Planned:
    """Solve the ILP and both baselines; return the plan of ``request.strategy``."""
    profile.check_covers(graph)
    cost = CostModel(
        graph=graph, profile=profile, network=network, global_batch=request.global_batch,
        optimizer=request.optimizer,
    )
    limits = Limits(
        amplification=request.amplification,
        memory_bytes=profile.memory_bytes if request.enforce_memory else None,
    )
    counts = thinned_counts(request.gpus, request.global_batch, request.max_candidates)
    options = {layer.name: allowed_counts(cost, layer, counts, limits) for layer in graph.layers}
    check_memory(cost, options, limits)
    result = solve(cost, options, memory_bytes=limits.memory_bytes, time_limit_s=request.time_limit_s,
                   solver=request.solver)
    assignments = {
        Strategy.DATA_PARALLEL: baselines.data_parallel(cost, request.gpus),
        Strategy.DEEPPOOL: baselines.deeppool_dp(cost, request.gpus, request.amplification),
        Strategy.ILP: result.assignment,
    }
    status = result.status
    best_baseline = _best_feasible_baseline(cost, assignments, options, limits)
    solved_ms = cost.iteration_ms(result.assignment)
    if best_baseline is not None and cost.iteration_ms(best_baseline) < solved_ms * (1 - 1e-9):
        assignments[Strategy.ILP] = best_baseline
        status = f"{status} (a baseline was better within the time limit and is kept)"
    times = {strategy: cost.iteration_ms(a) for strategy, a in assignments.items()}
    info = SolverInfo(name=result.solver.value, status=status, seconds=result.seconds, gap=result.gap)
    plan = build_plan(
        cost,
        assignments[request.strategy],
        model=model,
        gpus=request.gpus,
        strategy=request.strategy,
        amplification_limit=request.amplification,
        solver=info,
        baselines=times,
    )
    return Planned(plan=plan, assignments=assignments, cost=cost)


def _best_feasible_baseline(
    cost: CostModel,
    assignments: dict[Strategy, dict[str, int]],
    options: dict[str, tuple[int, ...]],
    limits: Limits,
) -> dict[str, int] | None:
    counts = sorted({g for allowed in options.values() for g in allowed})
    feasible = []
    for strategy in (Strategy.DATA_PARALLEL, Strategy.DEEPPOOL):
        mapped = {name: _smallest_equivalent(cost, g, counts) for name, g in assignments[strategy].items()}
        within = all(mapped[name] in options[name] for name in mapped)
        memory_ok = limits.memory_bytes is None or cost.peak_memory_bytes(mapped) <= limits.memory_bytes
        if within and memory_ok:
            feasible.append(mapped)
    return min(feasible, key=cost.iteration_ms, default=None)


def _smallest_equivalent(cost: CostModel, gpus: int, counts: list[int]) -> int:
    share = cost.per_gpu_batch(gpus)
    return next((g for g in counts if cost.per_gpu_batch(g) == share), gpus)


def planner_batches(gpus: int, global_batch: int) -> tuple[int, ...]:
    """Every per-GPU batch the planner may use for ``gpus`` and ``global_batch``."""
    return tuple(sorted({-(-global_batch // g) for g in useful_counts(gpus, global_batch)}))


def device_setup(device_model: str, global_batch: int, gpus: int, graph: LayerGraph) -> tuple[Profile, NetworkModel]:
    """An estimated profile and the network preset of a named device model."""
    known = known_device(device_model)
    return estimated_profile(graph, DEVICES[known], planner_batches(gpus, global_batch)), NETWORKS[known]


def source_profile(source: CostSource, traced: Traced, loaded: LoadedModel, request: PlanRequest) -> Profile:
    """The layer times ``source`` names: read, estimated for a device model, or measured here."""
    if source.profile_path is not None:
        return Profile.load(source.profile_path)
    if source.device_model != LOCAL:
        return device_setup(source.device_model, request.global_batch, request.gpus, traced.graph)[0]
    batches = planner_batches(request.gpus, request.global_batch)
    measured = tuple(b for b in batches if b <= source.max_measured_batch) or (min(batches),)
    config = ProfilerConfig(
        device=source.local_device, batches=measured, cache_dir=source.cache_dir,
        show_progress=source.show_progress,
    )
    return measure_profile(traced, loaded, config)


def plan_model(spec: ModelSpec, request: PlanRequest, source: CostSource) -> Planned:
    """Trace the model ``spec`` names, get its layer times from ``source``, plan it."""
    loaded = spec.load(meta=not source.measures_locally)
    traced = trace(loaded)
    if source.measures_locally:
        check_per_sample(traced, loaded, seed=spec.seed)
    profile = source_profile(source, traced, loaded, request)
    return plan_graph(traced.graph, profile, source.network_model(profile), request, model=spec)


def plan(
    module: nn.Module,
    example_inputs: tuple[torch.Tensor, ...] | torch.Tensor,
    *,
    gpus: int,
    global_batch: int | None = None,
    device_model: str = "a100",
    strategy: Strategy = Strategy.ILP,
    amplification: float | None = None,
    model_spec: ModelSpec | None = None,
) -> Plan:
    """Plan ``module`` for ``gpus`` GPUs of ``device_model`` from Python.

    ``example_inputs`` (a tensor or a tuple of them) carry the batch in
    dimension 0; the global batch defaults to their batch size. ``model_spec``
    says how other processes rebuild the model; without it the plan records
    the module's class when ``Class()`` rebuilds the same module, and
    otherwise that it was built in Python: ``deeppool.run(plan, model=module)``
    runs such a plan.
    """
    example = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    batch = global_batch or int(example[0].shape[0])
    request = PlanRequest(gpus=gpus, global_batch=batch, strategy=strategy, amplification=amplification)
    check_samples(gpus, batch)
    loaded = LoadedModel(module=module, inputs=_repeat(example), targets=lambda b: None, loss=default_loss)
    graph = trace(loaded).graph
    profile, network = device_setup(device_model, batch, gpus, graph)
    spec = model_spec or python_spec(module, example)
    return plan_graph(graph, profile, network, request, model=spec).plan


def python_spec(module: nn.Module, example: tuple[torch.Tensor, ...]) -> ModelSpec:
    """How another process rebuilds ``module``: its class with no arguments, else only with the module itself.

    Either way the one input's per-sample shape and dtype are kept, so the module itself can run the plan.
    """
    cls = type(module)
    location = f"{cls.__module__}:{cls.__qualname__}"
    first = example[0]
    if len(example) != 1 or first.dim() < 2:
        return ModelSpec(source=ModelSource.PYTHON, location=location)
    rebuilds = _class_rebuilds(module)
    return ModelSpec(
        source=ModelSource.FACTORY if rebuilds else ModelSource.PYTHON, location=location,
        input_shape=tuple(first.shape[1:]), input_dtype=str(first.dtype).removeprefix("torch."),
        vocab_size=0 if first.is_floating_point() else int(first.max()) + 1, root=os.getcwd() if rebuilds else "",
    )


def _class_rebuilds(module: nn.Module) -> bool:
    """Whether ``type(module)()``, imported by name in another process, has ``module``'s parameters and buffers."""
    cls = type(module)
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        return False
    try:
        imported = importlib.import_module(cls.__module__)
        if operator.attrgetter(cls.__qualname__)(imported) is not cls:
            return False
        with torch.device("meta"):
            rebuilt = cls()
    except Exception:  # any failure to import or construct means: not rebuildable by name
        return False
    return _shapes(rebuilt) == _shapes(module)


def _shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in module.state_dict().items()}


def _repeat(example: tuple[torch.Tensor, ...]):
    def make(batch_size: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[torch.arange(batch_size) % t.shape[0]] for t in example)

    return make
