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
from collections.abc import Callable, Iterable, Sized
from dataclasses import dataclass, replace
from typing import Any

import torch

from deeppool.adaptation.policy import Policy
from deeppool.errors import DeeppoolError
from deeppool.executor.adapt import Adapter, EventLog, Progress, Resize
from deeppool.executor.checkpoint import Shard, latest, load_for, save
from deeppool.executor.comm import Comm
from deeppool.executor.config import CheckpointConfig, RunConfig
from deeppool.executor.data import BatchSource, LoaderBatches, SyntheticBatches
from deeppool.executor.engine import Engine, EngineParts
from deeppool.executor.faults import Slowdown
from deeppool.executor.gradients import FIRST_BUCKET_BYTES, GradientReducer
from deeppool.executor.idle import IdleListener, NoBackground
from deeppool.executor.local_model import LocalModel, check_plan_matches, hold
from deeppool.executor.steptimes import StepMonitor
from deeppool.executor.outputs import RESIZE
from deeppool.executor.program import Program, build_program, idle_positions
from deeppool.executor.reference import CheckResult, LockstepReference, worst_of
from deeppool.executor.summary import RunSummary, summarise_run
from deeppool.executor.syncbn import Reduce
from deeppool.executor.timing import Category, Clock, EventClock, Recorder, RankTimes, Span, summarise
from deeppool.output import console
from deeppool.planner.graph import TraceMethod
from deeppool.planner.jsonio import write_json
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
    policy: Policy | None = None,
    slowdown: Slowdown | None = None,
) -> RankResult:
    """Train rank ``comm.rank`` of ``plan``; ``data`` yields global ``(inputs, targets)``.

    ``policy`` adapts the run (:mod:`deeppool.adaptation.policy`); ``slowdown`` injects a slow rank (tests).
    """
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
    recorder = Recorder(clock, _cuda_events(device), None if device.type == "cuda" else time.thread_time)
    local = hold(plan, module, traced.graph, comm.rank, lambda ranks: _group_sum(comm, ranks, recorder), program.stages,
                 traced.random)
    reference = None if reference_model is None else LockstepReference(
        reference_model, config.optimizer, params=local.params, buffers=local.buffers, rank=comm.rank,
        bound=config.check_bound, random=traced.random.mode(plan.model.seed), training=config.training,
    )
    engine = _engine(plan, program, local, comm, loaded, config, recorder, on_idle, device, reference, slowdown)
    losses: list[float] = []
    checks: list[CheckResult] = []
    first, progress = _resume(config, engine, local, comm.rank)
    adapter = _adapter(plan, program, comm, recorder, engine, config, progress, policy)
    for index in range(progress.position):  # the data position: the batches the resumed steps trained on
        batches(index)
    for step in range(first, config.steps):
        adapter.before_step(step)
        micros, position = adapter.accumulate, adapter.progress.position
        batch = [batches(position + micro) for micro in range(micros)]
        losses.append(engine.step(step, batch, position))
        if reference is not None:
            checks.append(reference.step(step, batch))
        stop = adapter.after_step(step, micros, last=step + 1 == config.steps) or _epoch_ends(adapter, data, position, position + micros, step + 1, config.steps)
        _save(_where(config, stop), step + 1, engine, local, comm, adapter.progress, force=stop)
        if stop:
            _resize(adapter, config, step + 1, comm.rank)
            break
    times = summarise(recorder.spans, rank=comm.rank, warmup=config.warmup)
    check = worst_of(checks)
    gathered = comm.gather((times, tuple(losses), check))
    summary = None
    if gathered is not None:
        summary = summarise_run(
            plan, program.stages, [g[0] for g in gathered], [g[1] for g in gathered], [g[2] for g in gathered],
            steps=config.steps, synchronous_allreduce=config.bucket_mb == 0,
            adaptation=adapter.report(),
        )
    return RankResult(
        rank=comm.rank, losses=tuple(losses), times=times, spans=tuple(recorder.spans), check=check,
        params={name: p.detach() for name, p in local.params.items()}, buffers=dict(local.buffers), summary=summary,
    )


def _resume(config: RunConfig, engine: Engine, local: LocalModel, rank: int) -> tuple[int, Progress]:
    """Load the latest complete checkpoint into this rank (``--resume``); the steps it had done, and where."""
    checkpoint = config.checkpoint
    fresh = Progress(accumulate=config.training.accumulate, position=0, lr=config.optimizer.lr)
    if checkpoint is None or not checkpoint.resume:
        return 0, fresh
    done = latest(checkpoint.directory)
    if done is None:
        return 0, fresh
    shard = load_for(checkpoint.directory, done, rank, list(local.params))
    with torch.no_grad():
        for name, value in shard.params.items():
            local.params[name].copy_(value)
        for name in local.buffers:
            local.buffers[name].copy_(shard.buffers[name])
    parts = engine.p
    if parts.optimizer is not None and shard.optimizer is not None:
        parts.optimizer.load_state_dict(shard.optimizer)
    if parts.scheduler is not None and shard.scheduler is not None:
        parts.scheduler.load_state_dict(shard.scheduler)
    if shard.progress is None:  # written before policies: K never changed
        return done, replace(fresh, position=done * fresh.accumulate)
    return done, Progress(**shard.progress)


def _save(checkpoint: CheckpointConfig | None, done: int, engine: Engine, local: LocalModel, comm: Comm,
          progress: Progress, *, force: bool = False) -> None:
    if checkpoint is None or (not force and (checkpoint.every == 0 or done % checkpoint.every != 0)):
        return
    parts = engine.p
    shard = Shard(
        steps_done=done,
        params={name: p.detach().cpu().clone() for name, p in local.params.items()},
        buffers={name: b.detach().cpu().clone() for name, b in local.buffers.items()},
        optimizer=parts.optimizer.state_dict() if parts.optimizer is not None else None,
        scheduler=parts.scheduler.state_dict() if parts.scheduler is not None else None,
        progress=progress.to_json(),
    )
    save(checkpoint.directory, comm.rank, shard, barrier=lambda: comm.all_reduce_max(0.0))


def _where(config: RunConfig, stop: bool) -> CheckpointConfig | None:
    """The checkpoint settings; a run a policy stops checkpoints to ``--checkpoint-dir`` or ``<out>/checkpoint``."""
    if config.checkpoint is not None or not stop:
        return config.checkpoint
    if config.out_dir is None:
        raise DeeppoolError("a policy asked for another GPU count, and the run has nowhere to checkpoint: "
                            "give --checkpoint-dir (or --out)")
    return CheckpointConfig(directory=config.out_dir / "checkpoint")


def _resize(adapter: Adapter, config: RunConfig, done: int, rank: int) -> None:
    """Rank 0 records the GPU request next to the run's outputs (``<out>/resize.json``) for the CLI."""
    checkpoint = _where(config, True)
    request = adapter.requested
    if rank != 0 or config.out_dir is None or request is None or checkpoint is None:
        return
    resize = Resize(gpus=request.gpus, steps_done=done, checkpoint=str(checkpoint.directory), reason=request.reason)
    write_json(config.out_dir / RESIZE, resize.to_json())


def _epoch_ends(adapter: Adapter, data: Iterable[Any] | None, start: int, end: int, done: int, steps: int) -> bool:
    """Call ``after_epoch`` when the step (global batches ``start..end``) finished a pass over ``data``
    (synthetic data has no passes: when the run ends)."""
    length = len(data) if isinstance(data, Sized) else None
    ended = end // length > start // length if length else done == steps
    return adapter.after_epoch(done) if ended else False


def _adapter(plan: Plan, program: Program, comm: Comm, recorder: Recorder, engine: Engine, config: RunConfig,
             progress: Progress, policy: Policy | None) -> Adapter:
    log = EventLog(out_dir=config.out_dir, show=_show) if comm.rank == 0 else None
    monitor = StepMonitor(plan, program.stages, comm, recorder, every=config.monitor_every)
    return Adapter(monitor=monitor, policy=policy, progress=progress,
                   gpus=plan.gpus, global_batch=plan.global_batch, optimizer=engine.p.optimizer,
                   scheduler=engine.p.scheduler, log=log)


def _show(message: str) -> None:
    console().print(message, highlight=False, markup=False)


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


def _group_sum(comm: Comm, ranks: tuple[int, ...], recorder: Recorder) -> Reduce:
    """SyncBatchNorm's sum over ``ranks``, recorded as communication (inside its stage's compute span)."""

    def reduce(tensor: torch.Tensor) -> None:
        with recorder.span(recorder.step, f"syncbn:{len(ranks)} ranks", Category.COMM):
            comm.all_reduce(tensor, ranks)

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
    slowdown: Slowdown | None,
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
            slowdown=slowdown,
        )
    )
