"""The planning pipeline: a traced graph and a profile in, a Plan out.

:func:`plan_graph` is what the CLI, the coordinator and the simulator call:
it builds the cost model, computes the baselines and the ILP optimum in the
same run (:mod:`deeppool.planner.strategies`), refuses figures that break the
cost model's invariants, and writes the plan of the chosen strategy. :func:`plan` is the
Python entry point for an ``nn.Module`` and example inputs.
"""

from __future__ import annotations

import importlib
import operator
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

import torch
from torch import nn

from deeppool.model.batching import check_per_sample
from deeppool.model.graph import LayerGraph
from deeppool.model.loading import LoadedModel, default_loss
from deeppool.model.trace import Traced, trace, trace_spec
from deeppool.plans import ClusterShares, ModelSource, ModelSpec, NetworkModel, Objective, Pin, Plan, Precision, Strategy
from deeppool.planner.hardware import DEVICES, NETWORKS, known_device
from deeppool.planner.measure_loop import evidence, plan_on_measured
from deeppool.planner.profiling.kfac_times import KfacTimes, kfac_layers, measure_kfac
from deeppool.planner.profiling.profile import Profile, estimated_profile
from deeppool.planner.profiling.profiler import LayerProfiler, ProfilerConfig
from deeppool.planner.profiling.timing import intra_op_threads
from deeppool.planner.request import LOCAL, CostSource, PlanRequest, check_precision, check_samples
from deeppool.planner.solve.build import build_plan
from deeppool.planner.solve.candidates import Limits, useful_counts
from deeppool.planner.solve.cost import CostModel, check_invariants
from deeppool.planner.solve.throughput import right_sizing, shares
from deeppool.planner.strategies import Search, solve_all

__all__ = ["LOCAL", "CostSource", "Pin", "PlanRequest", "Planned", "batch_planner", "device_setup", "plan", "plan_graph", "plan_model"]


@dataclass(frozen=True, kw_only=True)
class Planned:
    """The written plan and the assignments of every strategy, costed alike."""

    plan: Plan
    assignments: dict[Strategy, dict[str, int]]
    cost: CostModel
    search: Search


def plan_graph(
    graph: LayerGraph,
    profile: Profile,
    network: NetworkModel,
    request: PlanRequest,
    *,
    model: ModelSpec,
    module: nn.Module | None = None,
) -> Planned:
    """Solve the ILP and its baselines; return the plan of ``request.strategy``. ``module``: the traced model
    (its parameters may be meta tensors), whose ``Linear`` and ``Conv2d`` shapes K-FAC's work is timed on."""
    profile.check_covers(graph)
    cost = CostModel(
        graph=graph, profile=profile, network=network, global_batch=request.global_batch,
        optimizer=request.optimizer, precision=Precision.of_profile(profile.dtype),
        bucket_bytes=int(request.bucket_mb * 2**20),
    )
    cost = replace(cost, kfac_times=_kfac_times(cost, module))
    limits = Limits(
        amplification=request.amplification,
        memory_bytes=profile.memory_bytes if request.enforce_memory else None,
    )
    search = Search(
        gpus=request.gpus, limits=limits, max_candidates=request.max_candidates,
        time_limit_s=request.time_limit_s, solver=request.solver, objective=request.objective, price=request.price,
        pins=request.pins, interference=request.interference, cluster_gap=request.cluster_gap,
    )
    solved = solve_all(cost, search)
    chosen = solved.assignments[request.strategy]
    check_invariants(cost, chosen)
    plan = build_plan(
        cost,
        chosen,
        model=model,
        gpus=request.gpus,
        strategy=request.strategy,
        amplification_limit=request.amplification,
        solver=solved.solver,
        baselines=solved.baselines,
        pins=request.pins if request.strategy is Strategy.ILP else (),
        objective=request.objective if request.strategy is Strategy.ILP else Objective.TIME,
        cluster=cluster_shares(cost, chosen, request, solved.baselines.data_parallel_ms),
        evidence=evidence(cost, chosen, solved.assignments, one_gpu=request.amplification is not None),
    )
    return Planned(plan=plan, assignments=solved.assignments, cost=cost, search=search)


def _kfac_times(cost: CostModel, module: nn.Module | None) -> dict[str, KfacTimes]:
    """K-FAC's work timed here by the preconditioner itself, when its layers' times were measured here on a CPU
    (``--optimizer kfac``) and the traced model is at hand, with the profile's threads."""
    profile = cost.profile
    if not cost.preconditioned or module is None or profile.conditions is None or profile.concurrent_ranks is None:
        return {}
    threads = profile.conditions.threads or max(1, (os.cpu_count() or 1) // profile.concurrent_ranks)
    layers = kfac_layers(cost.graph, tuple(cost.preconditioned), module)
    return measure_kfac(layers, cost.global_batch, cost.kfac, threads=threads)


def cluster_shares(cost: CostModel, assignment: dict[str, int], request: PlanRequest, dp_ms: float) -> ClusterShares:
    """The plan's cluster throughput and the right-sizing baseline (:mod:`deeppool.planner.solve.throughput`)."""
    found = shares(cost, assignment, gpus=request.gpus, dp_ms=dp_ms, model=request.interference)
    width, value = right_sizing(cost, request.gpus, dp_ms)
    return ClusterShares(fg_share=found.fg_share, bg_share=found.bg_share, lent_fraction=found.lent_fraction,
                         right_sizing_gpus=width, right_sizing_throughput=value,
                         interference=request.interference_source)


def planner_batches(gpus: int, global_batch: int) -> tuple[int, ...]:
    """Every per-GPU batch the planner may use for ``gpus`` and ``global_batch``."""
    return tuple(sorted({-(-global_batch // g) for g in useful_counts(gpus, global_batch)}))


def device_setup(
    device_model: str, global_batch: int, gpus: int, graph: LayerGraph, precision: Precision | None = None,
) -> tuple[Profile, NetworkModel]:
    """An estimated profile (in ``precision``, the model's own by default) and the network preset of a device model."""
    known = known_device(device_model)
    batches = planner_batches(gpus, global_batch)
    return estimated_profile(graph, DEVICES[known], batches, precision), NETWORKS[known]


def source_profile(source: CostSource, traced: Traced, request: PlanRequest) -> Profile:
    """The layer times ``source`` names without measuring: read, or estimated for a device model."""
    if source.profile_path is not None:
        return Profile.load(source.profile_path)
    return device_setup(source.device_model, request.global_batch, request.gpus, traced.graph, request.precision)[0]


def local_profiler(source: CostSource, traced: Traced, loaded: LoadedModel, request: PlanRequest) -> LayerProfiler:
    """The profiler that measures here, on ``source.local_device`` with one rank's threads."""
    config = ProfilerConfig(
        device=source.local_device, cache_dir=source.cache_dir, show_progress=source.show_progress,
        threads=source.threads(request), ranks=request.gpus,
    )
    return LayerProfiler(traced, loaded, config)


def plan_model(spec: ModelSpec, request: PlanRequest, source: CostSource) -> Planned:
    """Trace the model ``spec`` names, get its layer times from ``source``, plan it."""
    return batch_planner(spec, request, source)(request.global_batch)


def batch_planner(spec: ModelSpec, request: PlanRequest, source: CostSource) -> Callable[[int], Planned]:
    """Trace the model once; the function plans ``request`` at any global batch, each with its own profile."""
    check_precision(request, source)
    loaded, traced = trace_spec(spec, meta=not source.measures_locally)
    profiler = None
    if source.measures_locally:
        with intra_op_threads(source.threads(request)):
            check_per_sample(traced, loaded, seed=spec.seed)
        profiler = local_profiler(source, traced, loaded, request)  # one for every batch: nothing measured twice

    def solve(batch: int) -> Planned:
        check_samples(request.gpus, batch)
        at = replace(request, global_batch=batch)

        def on(profile: Profile) -> Planned:
            return plan_graph(traced.graph, profile, source.network_model(profile), at, model=spec,
                              module=traced.module)

        if profiler is None:
            return on(source_profile(source, traced, at))
        return plan_on_measured(profiler, on, targets=planner_batches(at.gpus, batch), cap=source.max_measured_batch,
                                one_gpu=at.amplification is not None)

    return solve


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
    pins: Mapping[str, int] | Iterable[str | Pin] = (),
) -> Plan:
    """Plan ``module`` for ``gpus`` GPUs of ``device_model`` from Python.

    ``example_inputs`` (a tensor or a tuple of them) carry the batch in
    dimension 0; the global batch defaults to their batch size. ``model_spec``
    says how other processes rebuild the model; without it the plan records
    the module's class when ``Class()`` rebuilds the same module, and
    otherwise that it was built in Python: ``deeppool.run(plan, model=module)``
    runs such a plan. ``pins`` fixes layers' GPU counts, as ``{"layer4.*": 8}`` or
    ``["layer4.*=8"]`` (``deeppool plan --pin``); the ILP solves the rest.
    """
    example = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    batch = global_batch or int(example[0].shape[0])
    request = PlanRequest(gpus=gpus, global_batch=batch, strategy=strategy, amplification=amplification,
                          pins=parse_pins(pins))
    check_samples(gpus, batch)
    loaded = LoadedModel(module=module, inputs=_repeat(example), targets=lambda b: None, loss=default_loss)
    graph = trace(loaded).graph
    profile, network = device_setup(device_model, batch, gpus, graph)
    spec = model_spec or python_spec(module, example)
    return plan_graph(graph, profile, network, request, model=spec).plan


def parse_pins(pins: Mapping[str, int] | Iterable[str | Pin]) -> tuple[Pin, ...]:
    """Pins from ``{glob: gpus}``, ``"GLOB=N"`` strings or :class:`Pin` objects."""
    if isinstance(pins, Mapping):
        return tuple(Pin(pattern=str(pattern), gpus=int(gpus)) for pattern, gpus in pins.items())
    return tuple(pin if isinstance(pin, Pin) else Pin.parse(pin) for pin in pins)


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
