"""The planning pipeline: a traced graph and a profile in, a Plan out.

:func:`plan_graph` is what the CLI, the coordinator and the simulator call:
it builds the cost model, computes the baselines and the ILP optimum in the
same run (:mod:`deeppool.planner.strategies`), refuses figures that break the
cost model's invariants, and writes the plan of the chosen strategy. :func:`plan` is the
Python entry point for an ``nn.Module`` and example inputs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from deeppool.errors import DeeppoolError
from deeppool.planner.batching import check_per_sample
from deeppool.planner.candidates import Limits, useful_counts
from deeppool.planner.cost import DEFAULT_BUCKET_BYTES, CostModel, Optimizer, check_invariants
from deeppool.planner.graph import LayerGraph
from deeppool.planner.hardware import (
    DEVICES, LOCAL_NETWORK, NETWORKS, KnownDevice, NetworkModel, Precision, known_device,
)
from deeppool.planner.ilp import SolverName
from deeppool.planner.modelspec import LoadedModel, ModelSource, ModelSpec, default_loss
from deeppool.planner.plan import Plan, Strategy, build_plan
from deeppool.planner.profile import Profile, estimated_profile
from deeppool.planner.profiler import ProfilerConfig, intra_op_threads, measure_profile
from deeppool.planner.strategies import Objective, Search, check_objective, solve_all
from deeppool.planner.trace import Traced, trace

LOCAL = "local"
DEFAULT_MAX_CANDIDATES = 32
"""Keeps every useful count up to a global batch of about 300; thins larger problems."""


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """What to plan for: GPUs, global batch, strategy and limits."""

    gpus: int
    global_batch: int
    strategy: Strategy = Strategy.ILP
    optimizer: Optimizer = Optimizer.SGD
    amplification: float | None = None
    enforce_memory: bool = True
    time_limit_s: float = 60.0
    solver: SolverName | None = None
    max_candidates: int | None = DEFAULT_MAX_CANDIDATES
    bucket_mb: float = DEFAULT_BUCKET_BYTES / 2**20
    precision: Precision | None = None
    objective: Objective = Objective.TIME
    price: float = 0.0

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise DeeppoolError(f"--gpus {self.gpus}: plan for at least 1 GPU")
        if self.global_batch < 1:
            raise DeeppoolError(f"--batch {self.global_batch}: the global batch must be at least 1")
        if self.time_limit_s <= 0:
            raise DeeppoolError("--time-limit must be positive")
        if self.max_candidates is not None and self.max_candidates < 2:
            raise DeeppoolError("--max-candidates must be at least 2 (0 keeps every useful count)")
        if self.bucket_mb < 0:
            raise DeeppoolError(f"--bucket-mb {self.bucket_mb} must be >= 0")
        Limits(amplification=self.amplification)
        check_objective(self.objective, self.price)


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
) -> Planned:
    """Solve the ILP and its baselines; return the plan of ``request.strategy``."""
    profile.check_covers(graph)
    cost = CostModel(
        graph=graph, profile=profile, network=network, global_batch=request.global_batch,
        optimizer=request.optimizer, precision=Precision.of_profile(profile.dtype),
        bucket_bytes=int(request.bucket_mb * 2**20),
    )
    limits = Limits(
        amplification=request.amplification,
        memory_bytes=profile.memory_bytes if request.enforce_memory else None,
    )
    search = Search(
        gpus=request.gpus, limits=limits, max_candidates=request.max_candidates,
        time_limit_s=request.time_limit_s, solver=request.solver, objective=request.objective, price=request.price,
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
    )
    return Planned(plan=plan, assignments=solved.assignments, cost=cost, search=search)


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


@dataclass(frozen=True, kw_only=True)
class CostSource:
    """Where layer times come from: a device model, a profile file, or measuring here.

    ``device_model`` is v100/a100/h100 (estimated) or ``local`` (measured on
    ``local_device`` at a few per-GPU batches up to ``max_measured_batch``,
    :func:`measured_batches`, and fitted to the planner's). ``network`` names a
    preset (a device model or ``local``), ``network_file`` a measured network
    (``deeppool profile-network``) instead; the three overrides replace figures.
    """

    device_model: str = LOCAL
    profile_path: Path | None = None
    local_device: str = "cpu"
    max_measured_batch: int = 8
    cache_dir: Path | None = None
    network: str | None = None
    network_file: Path | None = None
    gpus_per_node: int | None = None
    intra_gbps: float | None = None
    inter_gbps: float | None = None
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.device_model != LOCAL:
            known_device(self.device_model)
        if self.network not in (None, LOCAL):
            known_device(self.network)
        if self.network is not None and self.network_file is not None:
            raise DeeppoolError("give either --network or --network-file, not both")
        if self.network_file is not None:
            NetworkModel.load(self.network_file)  # a bad file is refused before any tracing
        if self.max_measured_batch < 1:
            raise DeeppoolError("--max-measured-batch must be >= 1")

    @property
    def measures_locally(self) -> bool:
        return self.profile_path is None and self.device_model == LOCAL

    def network_model(self, profile: Profile) -> NetworkModel:
        if self.network_file is not None:
            base = NetworkModel.load(self.network_file)
        else:
            preset = self.network or self._preset_for(profile)
            base = LOCAL_NETWORK if preset == LOCAL else NETWORKS[known_device(preset)]
        return base.with_overrides(
            gpus_per_node=self.gpus_per_node, intra_gbps=self.intra_gbps, inter_gbps=self.inter_gbps
        )

    def _preset_for(self, profile: Profile) -> str:
        if self.profile_path is None:
            return self.device_model
        named = [known.value for known in KnownDevice if known.value in profile.device.lower()]
        return named[0] if named else LOCAL

    def threads(self, request: PlanRequest) -> int | None:
        """Intra-op threads while measuring on the CPU: one rank's share of the cores (None on a GPU)."""
        return rank_threads(request.gpus) if self.local_device == "cpu" else None

    def profile(self, traced: Traced, loaded: LoadedModel, request: PlanRequest) -> Profile:
        if self.profile_path is not None:
            return Profile.load(self.profile_path)
        if self.device_model != LOCAL:
            return device_setup(
                self.device_model, request.global_batch, request.gpus, traced.graph, request.precision
            )[0]
        batches = planner_batches(request.gpus, request.global_batch)
        config = ProfilerConfig(
            device=self.local_device, batches=measured_batches(self.max_measured_batch, max(batches)),
            fit_to=batches, cache_dir=self.cache_dir, show_progress=self.show_progress,
            threads=self.threads(request),
        )
        return measure_profile(traced, loaded, config)


def rank_threads(gpus: int) -> int:
    """The intra-op threads a rank of a ``gpus``-rank run on this host gets: its share of the cores."""
    return max(1, (os.cpu_count() or 1) // gpus)


def measured_batches(largest: int, needed: int) -> tuple[int, ...]:
    """The per-GPU batches measured locally: powers of two up to ``largest`` and ``needed``, from 2 when 3 remain."""
    limit = min(largest, needed)
    powers = tuple(2**k for k in range(limit.bit_length()))
    return powers[1:] if len(powers) > 3 else powers


def plan_model(spec: ModelSpec, request: PlanRequest, source: CostSource) -> Planned:
    """Trace the model ``spec`` names, get its layer times from ``source``, plan it."""
    if request.precision is not None and source.device_model == LOCAL:
        raise DeeppoolError(
            f"--precision {request.precision.value} applies to a --device-model (v100, a100, h100); "
            "a measured profile keeps the precision it was measured in"
        )
    loaded = spec.load(meta=not source.measures_locally)
    traced = trace(loaded)
    if source.measures_locally:
        with intra_op_threads(source.threads(request)):
            check_per_sample(traced, loaded, seed=spec.seed)
    profile = source.profile(traced, loaded, request)
    return plan_graph(traced.graph, profile, source.network_model(profile), request, model=spec)


def plan(
    module: nn.Module,
    example_inputs: tuple[torch.Tensor, ...],
    *,
    gpus: int,
    global_batch: int | None = None,
    device_model: str = "a100",
    strategy: Strategy = Strategy.ILP,
    amplification: float | None = None,
    model_spec: ModelSpec | None = None,
) -> Plan:
    """Plan ``module`` for ``gpus`` GPUs of ``device_model`` from Python.

    ``example_inputs`` carry the batch in dimension 0; the global batch defaults
    to their batch size. ``model_spec`` says how other processes rebuild the
    model; by default the module's class is rebuilt with no arguments.
    """
    batch = global_batch or int(example_inputs[0].shape[0])
    request = PlanRequest(gpus=gpus, global_batch=batch, strategy=strategy, amplification=amplification)
    loaded = LoadedModel(
        module=module, inputs=_repeat(example_inputs), targets=lambda b: None, loss=default_loss
    )
    graph = trace(loaded).graph
    profile, network = device_setup(device_model, batch, gpus, graph)
    spec = model_spec or ModelSpec(
        source=ModelSource.FACTORY,
        location=f"{type(module).__module__}:{type(module).__qualname__}",
        input_shape=tuple(example_inputs[0].shape[1:]),
    )
    return plan_graph(graph, profile, network, request, model=spec).plan


def _repeat(example: tuple[torch.Tensor, ...]):
    def make(batch_size: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[torch.arange(batch_size) % t.shape[0]] for t in example)

    return make
