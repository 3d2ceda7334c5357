"""The Python API: train one rank of a plan with injected communication.

:func:`train_rank` is what every rank runs (the worker calls it with a
:class:`~deeppool.executor.comm.TorchComm`; tests call it with a fake). It
rebuilds and checks the model, runs ``config.steps`` iterations (with ``check``,
each followed by the same step of single-process training; gradients, buffers
and parameters are compared, then realigned:
:class:`~deeppool.executor.reference.LockstepReference`) and
returns this rank's result;
rank 0's result carries the :class:`RunSummary` of all ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from deeppool.errors import DeeppoolError
from deeppool.executor.checkpoint import Shard, latest, load, save
from deeppool.executor.comm import Comm, Lane
from deeppool.executor.config import CheckpointConfig, RunConfig
from deeppool.executor.data import BatchSource, LoaderBatches, SyntheticBatches
from deeppool.executor.engine import Engine, EngineParts
from deeppool.executor.gradients import FIRST_BUCKET_BYTES, GradientReducer
from deeppool.executor.idle import IdleListener, NoBackground
from deeppool.executor.local_model import LocalModel, check_plan_matches, hold
from deeppool.executor.program import Program, build_program, idle_positions
from deeppool.executor.reference import CheckResult, LockstepReference, worst_of
from deeppool.executor.summary import RunSummary, summarise_run
from deeppool.executor.syncbn import Reduce
from deeppool.executor.timing import Clock, EventClock, Recorder, RankTimes, Span, summarise
from deeppool.planner.graph import TraceMethod
from deeppool.planner.modelspec import LoadedModel, ModelSpec
from deeppool.planner.plan import Plan
from deeppool.planner.trace import Traced, trace


@dataclass(frozen=True, kw_only=True)
class RankResult:
    rank: int
    losses: tuple[float, ...]
    times: RankTimes
    spans: tuple[Span, ...]
    check: CheckResult | None
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    summary: RunSummary | None


def train_rank(
    plan: Plan,
    *,
    comm: Comm,
    config: RunConfig,
    data: Iterable[Any] | None = None,
    on_idle: IdleListener | None = None,
    clock: Clock = time.perf_counter,
    device: torch.device | None = None,
    builder: ModelBuilder | None = None,
) -> RankResult:
    """Train rank ``comm.rank`` of ``plan``; ``data`` yields global ``(inputs, targets)``."""
    builder = builder or ModelBuilder()
    device = device or torch.device("cpu")
    if comm.world_size != plan.gpus:
        raise DeeppoolError(f"the plan is for {plan.gpus} GPUs but {comm.world_size} ranks were started: "
                            f"start {plan.gpus} (--nproc {plan.gpus})")
    loaded = builder.load(plan.model)
    batches = _batches(loaded, plan, data)
    traced = builder.trace(loaded)
    check_plan_matches(plan, traced.graph)
    reference_model = builder.load(plan.model) if config.check else None
    module = _training(traced).to(device)
    module.zero_grad(set_to_none=True)  # tracing measures backward FLOPs and leaves gradients
    program = build_program(plan, traced.graph, comm.rank)
    local = hold(plan, module, traced.graph, comm.rank, lambda ranks: _group_sum(comm, ranks), program.stages,
                 traced.random, config.batchnorm)
    reference = None if reference_model is None else LockstepReference(
        reference_model, config.optimizer, params=local.params, buffers=local.buffers, rank=comm.rank,
        bound=config.check_bound, random=traced.random.mode(plan.model.seed), training=config.training,
    )
    recorder = Recorder(clock, _cuda_events(device))
    engine = _engine(plan, program, local, comm, loaded, config, recorder, on_idle, device, reference)
    losses: list[float] = []
    checks: list[CheckResult] = []
    micros = config.training.accumulate
    first = _resume(config.checkpoint, engine, local, comm.rank)
    for index in range(first * micros):  # the data position: the batches the resumed steps trained on
        batches(index)
    for step in range(first, config.steps):
        batch = [batches(step * micros + micro) for micro in range(micros)]
        losses.append(engine.step(step, batch))
        if reference is not None:
            checks.append(reference.step(step, batch))
        _save(config.checkpoint, step + 1, engine, local, comm)
    times = summarise(recorder.spans, rank=comm.rank, warmup=config.warmup)
    check = worst_of(checks)
    gathered = comm.gather((times, tuple(losses), check))
    summary = None
    if gathered is not None:
        summary = summarise_run(
            plan, program.stages, [g[0] for g in gathered], [g[1] for g in gathered], [g[2] for g in gathered],
            steps=config.steps, synchronous_allreduce=config.bucket_mb == 0,
        )
    return RankResult(
        rank=comm.rank, losses=tuple(losses), times=times, spans=tuple(recorder.spans), check=check,
        params={name: p.detach() for name, p in local.params.items()}, buffers=dict(local.buffers), summary=summary,
    )


def _resume(checkpoint: CheckpointConfig | None, engine: Engine, local: LocalModel, rank: int) -> int:
    """Load the latest complete checkpoint into this rank (``--resume``); the steps it had done."""
    if checkpoint is None or not checkpoint.resume:
        return 0
    done = latest(checkpoint.directory)
    if done is None:
        return 0
    shard = load(checkpoint.directory, done, rank)
    with torch.no_grad():
        for name, value in shard.params.items():
            local.params[name].copy_(value)
        for name, value in shard.buffers.items():
            local.buffers[name].copy_(value)
    parts = engine.p
    if parts.optimizer is not None and shard.optimizer is not None:
        parts.optimizer.load_state_dict(shard.optimizer)
    if parts.scheduler is not None and shard.scheduler is not None:
        parts.scheduler.load_state_dict(shard.scheduler)
    return done


def _save(checkpoint: CheckpointConfig | None, done: int, engine: Engine, local: LocalModel, comm: Comm) -> None:
    if checkpoint is None or checkpoint.every == 0 or done % checkpoint.every != 0:
        return
    parts = engine.p
    shard = Shard(
        steps_done=done,
        params={name: p.detach().cpu().clone() for name, p in local.params.items()},
        buffers={name: b.detach().cpu().clone() for name, b in local.buffers.items()},
        optimizer=parts.optimizer.state_dict() if parts.optimizer is not None else None,
        scheduler=parts.scheduler.state_dict() if parts.scheduler is not None else None,
    )
    save(checkpoint.directory, comm.rank, shard, barrier=lambda: comm.all_reduce_max(0.0))


class ModelBuilder:
    """Builds and traces models; both touch process-global state (the RNG, fx's patching),
    so ranks that share one process (tests) substitute a serialised builder."""

    def load(self, spec: ModelSpec) -> LoadedModel:
        return spec.load()

    def trace(self, loaded: LoadedModel) -> Traced:
        return trace(loaded)


def _batches(loaded: LoadedModel, plan: Plan, data: Iterable[Any] | None) -> BatchSource:
    if data is None:
        return SyntheticBatches(loaded, plan.global_batch)
    return LoaderBatches(data, plan.global_batch, loaded)


def _training(traced: Traced) -> torch.nn.Module:
    """The traced module in training mode (an exported graph was captured in it and has no mode)."""
    if traced.graph.method is TraceMethod.FX:
        traced.module.train()
    return traced.module


def _group_sum(comm: Comm, ranks: tuple[int, ...]) -> Reduce:
    """Synchronised BatchNorm's sum over ``ranks``, on its own lane (never behind a gradient bucket)."""

    def reduce(tensor: torch.Tensor) -> None:
        comm.all_reduce(tensor, ranks, lane=Lane.STATISTICS)

    return reduce


def _cuda_events(device: torch.device) -> EventClock | None:
    if device.type == "cuda":
        return lambda: torch.cuda.Event(enable_timing=True)
    return None


def _side_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The gradient all-reduce's own stream on a GPU (none on CPU)."""
    return torch.cuda.Stream(device) if device.type == "cuda" else None


def _synchronize(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def _engine(
    plan: Plan, program: Program, local: LocalModel, comm: Comm, loaded: LoadedModel, config: RunConfig,
    recorder: Recorder, on_idle: IdleListener | None, device: torch.device, reference: LockstepReference | None,
) -> Engine:
    optimizer = config.optimizer.build(local.params.values()) if local.params else None
    training = config.training
    return Engine(
        EngineParts(
            plan=plan,
            program=program,
            model=local,
            comm=comm,
            loss=loaded.loss,
            optimizer=optimizer,
            scheduler=training.schedule.build(optimizer) if optimizer is not None else None,
            clip_norm=training.clip_norm,
            reducer=GradientReducer(comm, config.bucket_bytes, _side_stream(device),
                                    first_bucket_bytes=FIRST_BUCKET_BYTES if device.type == "cuda" else None),
            recorder=recorder,
            idle=idle_positions(program, plan.idle_windows(comm.rank)),
            on_idle=on_idle or NoBackground(),
            device=device,
            on_gradients=None if reference is None else reference.gradients_reduced,
            overlap=config.bucket_bytes > 0,
            synchronize=_synchronize(device),
        )
    )
