"""A Plan derived from an assignment ``{layer: gpus}`` through the cost model, so nothing in a Plan is computed
twice in two ways."""

from __future__ import annotations

from deeppool.plans import (
    ClusterShares,
    Evidence,
    IdleWindow,
    ModelSpec,
    Objective,
    Pin,
    Plan,
    PlannedLayer,
    Prediction,
    SolverInfo,
    Strategy,
    sample_ranges,
)
from deeppool.planner.solve.baselines import Baselines
from deeppool.planner.solve.cost import CostModel, SchedulePhase


def build_plan(
    cost: CostModel,
    assignment: dict[str, int],
    *,
    model: ModelSpec,
    gpus: int,
    strategy: Strategy,
    amplification_limit: float | None,
    solver: SolverInfo,
    baselines: Baselines,
    pins: tuple[Pin, ...] = (),
    objective: Objective = Objective.TIME,
    cluster: ClusterShares | None = None,
    evidence: Evidence | None = None,
) -> Plan:
    """Everything a Plan states, derived from ``assignment`` through ``cost``."""
    rounds = cost.group_rounds_ms(assignment)
    staged = cost.stage_phases_ms(assignment)
    layers = tuple(_plan_layer(cost, layer.name, assignment[layer.name], rounds.get(layer.name, 0.0),
                               staged[layer.name]) for layer in cost.graph.layers)
    phases = cost.schedule(assignment)
    iteration = cost.iteration_ms(assignment)
    busy = sum((p.end_ms - p.start_ms) * p.ranks for p in phases)
    single = sum(cost.layer_ms(layer, 1) for layer in cost.graph.layers)
    dp, best = baselines.data_parallel_ms, baselines.best_data_parallel_ms
    predicted = Prediction(
        iteration_ms=iteration,
        data_parallel_iteration_ms=dp,
        deeppool_iteration_ms=baselines.deeppool_ms,
        speedup_vs_data_parallel=dp / iteration if iteration > 0 else 1.0,
        best_data_parallel_gpus=baselines.best_data_parallel_gpus,
        best_data_parallel_iteration_ms=best,
        speedup_vs_best_data_parallel=best / iteration if iteration > 0 else 1.0,
        gpu_seconds_per_iteration=busy / 1e3,
        amplification=busy / single if single > 0 else 1.0,
        idle_gpu_fraction=max(0.0, 1.0 - busy / (iteration * gpus)) if iteration > 0 else 0.0,
        peak_memory_bytes=cost.peak_memory_bytes(assignment),
        idle_windows=tuple(idle_windows(phases, gpus, iteration)),
        step_call_ms=cost.step_call_ms,
        loss_ms=sum(cost.loss_ms(cost.graph.layer(cost.graph.output), assignment[cost.graph.output])),
        uncertainty=sum(layer.spread * (layer.fwd_ms + layer.bwd_ms) for layer in layers) / iteration
        if iteration > 0 else 0.0,
    )
    return Plan(
        model=model,
        global_batch=cost.global_batch,
        gpus=gpus,
        device=cost.profile.device,
        network=cost.network,
        strategy=strategy,
        optimizer=cost.optimizer,
        preconditioned=tuple(cost.preconditioned),
        precision=cost.precision,
        amplification_limit=amplification_limit,
        layers=layers,
        predicted=predicted,
        solver=solver,
        pins=pins,
        objective=objective,
        cluster=cluster,
        branches=cost.graph.branches,
        draws=cost.graph.draws,
        evidence=evidence,
    )


def _plan_layer(cost: CostModel, name: str, gpus: int, rounds_ms: float, phases_ms: tuple[float, float]
                ) -> PlannedLayer:
    """The layer's figures; ``rounds_ms``: its rank group's all-reduce latency rounds, if it reports them;
    ``phases_ms``: its forward and backward phases in its stage (:meth:`CostModel.stage_phases_ms`)."""
    layer = cost.graph.layer(name)
    fwd, bwd = phases_ms
    return PlannedLayer(
        name=name,
        op=layer.op,
        opaque=layer.opaque,
        gpus=gpus,
        ranks=tuple(range(gpus)),
        samples=sample_ranges(cost.global_batch, gpus),
        fwd_ms=fwd,
        bwd_ms=bwd,
        allreduce_ms=cost.allreduce_ms(layer, gpus) + rounds_ms,
        step_ms=cost.step_ms(layer) + cost.kfac_ms(layer, gpus),
        amplification=cost.amplification(layer, gpus),
        memory_bytes=cost.memory_bytes(layer, gpus),
        spread=cost.profile.spread(name, cost.per_gpu_batch(gpus)),
    )


def idle_windows(phases: list[SchedulePhase], gpus: int, iteration_ms: float) -> list[IdleWindow]:
    """Maximal stretches in which a rank runs no phase; ``after`` is the last phase's layer."""
    return [window for rank in range(gpus) for window in rank_idle_windows(phases, rank, iteration_ms)]


def rank_idle_windows(phases: list[SchedulePhase], rank: int, iteration_ms: float) -> list[IdleWindow]:
    """Rank ``rank``'s idle windows: a rank that runs no phase has one, the whole iteration."""
    windows: list[IdleWindow] = []
    clock, after = 0.0, None
    for phase in phases:
        if phase.ranks <= rank:
            continue
        if phase.start_ms - clock > 1e-9:
            windows.append(IdleWindow(rank=rank, start_ms=clock, end_ms=phase.start_ms, after=after))
        clock, after = phase.end_ms, _label(phase)
    if iteration_ms - clock > 1e-9:
        windows.append(IdleWindow(rank=rank, start_ms=clock, end_ms=iteration_ms, after=after))
    return windows


def _label(phase: SchedulePhase) -> str:
    return f"{phase.kind.value}:{phase.layer}"
