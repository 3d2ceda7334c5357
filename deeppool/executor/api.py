"""The Python API: train one rank of a plan with injected communication.

:func:`train_rank` is what every rank runs (the worker calls it with a
:class:`~deeppool.executor.engine.comm.TorchComm`; tests call it with a fake). It
rebuilds and checks the model, runs ``config.steps`` iterations (with ``check``,
each followed by the same step of single-process training; gradients, buffers
and parameters are compared, then realigned:
:class:`~deeppool.executor.training.reference.LockstepReference`) and
returns this rank's result;
rank 0's result carries the :class:`RunSummary` of all ranks.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deeppool.adaptation.adascale import AdaScale
from deeppool.adaptation.kfac import KFACPreconditioner
from deeppool.adaptation.policy import AdaptationPolicy
from deeppool.device.cuda import gpu_for
from deeppool.device.seam import Gpu, event_factory, side_stream, synchronizer
from deeppool.errors import DeeppoolError
from deeppool.executor.config import (
    BatchNormMode,
    CheckpointConfig,
    LrScaling,
    RunConfig,
    check_adaptation,
    default_base_batch,
)
from deeppool.executor.engine.comm import Comm, Lane
from deeppool.executor.engine.data import (
    BatchSource,
    DataReport,
    DatasetBatches,
    EpochOrder,
    LoaderBatches,
    SyntheticBatches,
    load_dataset,
    needed_rows,
)
from deeppool.executor.engine.engine import Engine, EngineParts
from deeppool.executor.engine.faults import Slowdown
from deeppool.executor.engine.gradients import FIRST_BUCKET_BYTES, GradientReducer
from deeppool.executor.engine.idle import IdleListener, NoBackground
from deeppool.executor.engine.kfac_groups import kfac_groups
from deeppool.executor.engine.local_model import LocalModel, check_plan_matches, hold
from deeppool.executor.engine.monitor import AdaScaleLr, GnsReading, GradientMonitor, group_shares, single_groups
from deeppool.executor.engine.precision import AgreedScaler, MixedPrecision, output_dtypes
from deeppool.executor.engine.program import Program, build_program, idle_positions, pace_group
from deeppool.executor.engine.timing import Category, Clock, Counter, RankTimes, Recorder, Span, summarise
from deeppool.executor.training.adapt import Adapter, EventLog, Progress, Resize, StepLog
from deeppool.executor.training.checkpoint import (
    GroupShard,
    RunState,
    intact,
    latest,
    load_group,
    load_kfac,
    load_own,
    load_run,
    model_keys,
    save,
    writer,
)
from deeppool.executor.training.checkpoint import groups as checkpoint_groups
from deeppool.executor.training.outputs import RESIZE, STOPPED
from deeppool.executor.training.progress import ProgressFile
from deeppool.executor.training.reference import CheckResult, LockstepReference, worst_of
from deeppool.executor.training.steptimes import StepMonitor
from deeppool.executor.training.summary import RunSummary, summarise_run
from deeppool.model.graph import TraceMethod
from deeppool.model.loading import LoadedModel, load_model
from deeppool.model.syncbn import Reduce
from deeppool.model.trace import Traced, trace
from deeppool.output import console
from deeppool.plans import ModelSpec, Optimizer, Plan, Precision
from deeppool.plans.jsonio import write_json


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
    counters: tuple[Counter, ...] = ()
    gns: tuple[GnsReading, ...] = ()
    """Rank 0's noise-scale reading of every step it ran (``--monitor gns``); empty elsewhere."""


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
    policy: AdaptationPolicy | None = None,
    slowdown: Slowdown | None = None,
    gpu: Gpu | None = None,
) -> RankResult:
    """Train rank ``comm.rank`` of ``plan``.

    ``data``: an iterable of global ``(inputs, targets)`` batches (every rank reads them all), or a
    map-style ``torch.utils.data.Dataset`` of ``(input, target)`` samples, of which the rank loads
    only its rows (:class:`~deeppool.executor.engine.data.DatasetBatches`, ``config.data``'s seed and
    workers); None: ``config.data``'s dataset, else the model's synthetic batch. ``on_idle`` hears this
    rank's idle windows: give one on every rank or on none, since with listeners the ranks that run no
    layer follow rank 0's iterations (``EngineParts.pace``). ``policy`` adapts the
    run (:mod:`deeppool.adaptation.policy`); ``slowdown`` injects a slow rank (tests). ``gpu``: the
    device seam (:mod:`deeppool.device`; the real GPU of a CUDA ``device`` when not given, a fake in tests).
    """
    builder = builder or ModelBuilder()
    device = device or torch.device("cpu")
    gpu = gpu if gpu is not None else gpu_for(device)
    if comm.world_size != plan.gpus:
        raise DeeppoolError(f"the plan is for {plan.gpus} GPUs but {comm.world_size} ranks were started: "
                            f"start {plan.gpus} (--nproc {plan.gpus})")
    loaded = builder.load(plan.model)
    # ``--check``'s reference is a copy of ``loaded`` taken before the trace touches it (the model is built
    # once per rank)
    reference_model = builder.copy(loaded, plan.model) if config.check else None
    keys = model_keys(loaded.module)
    traced = builder.trace(loaded)
    check_plan_matches(plan, traced.graph)
    check_adaptation(plan, config, grouped=bool(group_shares(plan, traced.graph, 0)))
    feed = _feed(loaded, plan, traced, comm.rank, data, config)
    module = _training(traced).to(device)
    module.zero_grad(set_to_none=True)  # tracing measures backward FLOPs and leaves gradients
    precision = _precision(config, module, traced, loaded, device, comm)
    program = build_program(plan, traced.graph, comm.rank)
    recorder = Recorder(clock, event_factory(gpu), None if gpu is not None else time.thread_time)
    preconditioned = tuple(kfac_groups(plan, traced.graph, module, 0))  # the whole model's, before hold drops some
    local = hold(plan, module, traced.graph, comm.rank, lambda ranks: _group_sum(comm, ranks, recorder),
                 program.stages, traced.random, config.batchnorm)
    reference = None if reference_model is None else LockstepReference(
        reference_model, config.optimizer, params=local.params, buffers=local.buffers, rank=comm.rank,
        bound=config.bound, random=traced.random.mode(plan.model.seed), training=config.training,
        precision=config.precision, scaling=config.loss_scaling, branches=plan.branches,
        draws=plan.draws, kfac_modules=preconditioned if config.optimizer.kind is Optimizer.KFAC else (),
    )
    engine = _engine(plan, program, local, comm, loaded, config, recorder, on_idle, device, reference, precision,
                     slowdown, gpu)
    losses: list[float] = []
    checks: list[CheckResult] = []
    first, progress = _resume(config, engine, local, comm.rank)
    adapter = _adapter(plan, program, comm, recorder, engine, config, progress, policy)
    readings: list[GnsReading] = []
    shown = ProgressFile(out_dir=config.out_dir, steps=config.steps) if comm.rank == 0 and config.out_dir else None
    for step in range(first, config.steps):
        adapter.before_step(step)
        micros, position = adapter.accumulate, adapter.progress.position
        indices = range(position, position + micros)
        batch = [feed.batches(index) for index in indices]
        losses.append(engine.step(step, batch, position))
        monitor = engine.parts.monitor
        if monitor is not None and monitor.latest is not None:
            readings.append(monitor.latest)
        if reference is not None:
            whole = batch if feed.whole is None else [feed.whole(index) for index in indices]
            checks.append(reference.step(step, whole))
        gns = readings[-1].noise_scale if readings and comm.rank == 0 else None
        stop = adapter.after_step(step, micros, last=step + 1 == config.steps, gns=gns, loss=losses[-1])
        stop = stop or _epoch_ends(adapter, feed, position, position + micros, step + 1, config.steps)
        asked = not stop and step + 1 < config.steps and _stop_asked(config, comm)
        stop = stop or asked
        _save(_where(config, stop), step + 1, engine, local, comm, keys, adapter.progress, config.batchnorm,
              force=stop)
        if shown is not None:
            shown.update(step + 1)
        if asked:
            adapter.flush(step)
            _stopped(config, step + 1, comm.rank)
        if stop:
            _resize(adapter, config, step + 1, comm.rank)
            break
    position = adapter.progress.position
    times = summarise(recorder.spans, rank=comm.rank, warmup=config.warmup)
    check = worst_of(checks)
    gathered = comm.gather((times, tuple(losses), check))
    summary = None
    if gathered is not None:
        summary = summarise_run(
            plan, program.stages, [g[0] for g in gathered], [g[1] for g in gathered], [g[2] for g in gathered],
            steps=config.steps, synchronous_allreduce=config.bucket_mb == 0,
            adaptation=adaptation_report(engine), adapted=adapter.report(),
        )
        summary = dataclasses.replace(summary, precision=config.precision.value, data=feed.report(position))
    return RankResult(
        rank=comm.rank, losses=tuple(losses), times=times, spans=tuple(recorder.spans), check=check,
        params={name: p.detach() for name, p in local.params.items()}, buffers=dict(local.buffers), summary=summary,
        counters=tuple(recorder.counters), gns=tuple(readings),
    )


def adaptation_report(engine: Engine) -> dict[str, Any]:
    """summary.json's adaptation keys: ``gns`` (samples) and its statistics; AdaScale's τ and last gain."""
    report: dict[str, Any] = {}
    monitor, scaling = engine.parts.monitor, engine.parts.lr_scaling
    if monitor is not None:
        stats = None if monitor.latest is None else monitor.latest.to_json()
        report["gns"] = None if stats is None else stats["noise_scale"]
        report["gns_stats"] = stats
    if scaling is not None:
        scaler = scaling.scaler
        report["adascale"] = {"tau": scaler.tau, "gain": scaler.gain, "base_batch": scaler.base_batch,
                              "batch": scaler.batch, "scale": scaler.batch / scaler.base_batch}
    return report


def _resume(config: RunConfig, engine: Engine, local: LocalModel, rank: int) -> tuple[int, Progress]:
    """Load the latest complete checkpoint into this rank (``--resume``); the steps it had done and the
    progress (data position in global batches, accumulation, base LR). The rank reads the shard of every
    layer group it belongs to; under a plan for another GPU count (a policy's request) the checkpoint's
    groups differ, and it takes its tensors by name from every group's shard."""
    checkpoint = config.checkpoint
    fresh = Progress(accumulate=config.training.accumulate, position=0, lr=config.optimizer.lr,
                     asked_lr=config.optimizer.lr)
    if checkpoint is None or not checkpoint.resume:
        return 0, fresh
    done = intact(checkpoint.directory, lambda message: _show(f"warning: {message}") if rank == 0 else None)
    if done is None and latest(checkpoint.directory) is not None:
        raise DeeppoolError(f"every complete checkpoint in '{checkpoint.directory}' is damaged: run without --resume "
                            "to start over")
    if done is None:
        return 0, fresh
    run = load_run(checkpoint.directory, done)
    shards = _shards(checkpoint.directory, done, local, rank)
    for shard in shards:
        _copy_into(local.params, shard.params)
        _copy_into(local.buffers, shard.buffers)
    _copy_into(local.buffers, load_own(checkpoint.directory, done, rank))
    parts = engine.parts
    if parts.optimizer is not None and run.optimizer_groups is not None:
        states = {name: state for shard in shards for name, state in shard.optimizer.items()}
        parts.optimizer.load_state_dict(_optimizer_state(parts.optimizer, local, states, run.optimizer_groups))
    if parts.scheduler is not None and run.scheduler is not None:
        parts.scheduler.load_state_dict(run.scheduler)
    scaler = parts.precision.scaler
    if scaler is not None and run.scaler is not None:
        scaler.load_state_dict(run.scaler)
    _load_adaptation(parts, run.adaptation or {})
    kfac, preconditioner = load_kfac(checkpoint.directory, done, rank), parts.preconditioner
    if preconditioner is not None and kfac is not None and set(kfac["layers"]) == set(preconditioner.layers):
        preconditioner.load_state_dict(kfac)  # another plan's (a resize) differs: K-FAC starts afresh
    return done, Progress(**run.progress).asked(config.optimizer.lr)


def _copy_into(held: dict[str, torch.Tensor], stored: dict[str, torch.Tensor]) -> None:
    """Copy the stored tensors this rank holds into its own, by name."""
    with torch.no_grad():
        for name, value in stored.items():
            if name in held:
                held[name].copy_(value)


def _shards(directory: Path, done: int, local: LocalModel, rank: int) -> list[GroupShard]:
    """The shards holding this rank's tensors: those of the groups it belongs to, or, when the checkpoint lacks
    one or they miss some tensors (a checkpoint of a plan for another GPU count, after a policy's request or a
    resize: a 1-GPU plan's has no 2-GPU group), every group's, read by name."""
    present = set(checkpoint_groups(directory, done))
    mine = [load_group(directory, done, g) for g in sorted(set(local.groups.values())) if rank < g and g in present]
    held = {name for shard in mine for name in (*shard.params, *shard.buffers)}
    if held >= {*local.params, *local.buffers}:
        return mine
    return [load_group(directory, done, g) for g in checkpoint_groups(directory, done)]


def _load_adaptation(parts: EngineParts, state: dict[str, Any]) -> None:
    """The noise scale's moving averages (rank 0's) and AdaScale's τ and gain, from the run state."""
    if parts.monitor is not None and "gns" in state:
        parts.monitor.load_state_dict(state["gns"])
    if parts.lr_scaling is not None and "adascale" in state:
        parts.lr_scaling.load_state_dict(state["adascale"])


def _optimizer_state(
    optimizer: torch.optim.Optimizer, local: LocalModel, states: dict[str, dict[str, Any]],
    groups: list[dict[str, Any]],
) -> dict[str, Any]:
    """The rank's optimizer ``state_dict`` in torch's form (parameters by index) from states by name."""
    index = {id(param): i for i, param in enumerate(p for group in optimizer.param_groups for p in group["params"])}
    by_index = {index[id(local.params[name])]: state for name, state in states.items() if name in local.params}
    param_groups = [{**hyper, "params": [index[id(p)] for p in group["params"]]}
                    for hyper, group in zip(groups, optimizer.param_groups, strict=True)]
    return {"state": by_index, "param_groups": param_groups}


def _save(
    checkpoint: CheckpointConfig | None, done: int, engine: Engine, local: LocalModel, comm: Comm,
    keys: dict[str, str], progress: Progress, batchnorm: BatchNormMode, *, force: bool = False,
) -> None:
    if checkpoint is None or (not force and (checkpoint.every == 0 or done % checkpoint.every != 0)):
        return
    parts = engine.parts
    optimizer = parts.optimizer
    run = RunState(
        steps_done=done,
        optimizer_groups=None if optimizer is None else [
            {k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups],
        scheduler=parts.scheduler.state_dict() if parts.scheduler is not None else None,
        model_keys=keys,
        progress=progress.to_json(),
        scaler=parts.precision.scaler.state_dict() if parts.precision.scaler is not None else None,
        adaptation=_adaptation_state(parts),
    )
    groups = tuple(sorted({layer.gpus for layer in parts.plan.layers}))
    mine = next((g for g in groups if writer(g) == comm.rank), None)
    shard = None if mine is None else _group_shard(mine, local, optimizer)
    own = None if batchnorm is BatchNormMode.SYNC else {
        name: b.detach().cpu().clone() for name, b in local.buffers.items() if local.groups[name] > 1}
    kfac = None if parts.preconditioner is None else parts.preconditioner.state_dict()
    save(checkpoint.directory, comm.rank, run, shard, groups, barrier=lambda: comm.all_reduce_max(0.0), own=own,
         kfac=kfac)


def _group_shard(gpus: int, local: LocalModel, optimizer: torch.optim.Optimizer | None) -> GroupShard:
    """Layer group ``gpus``'s parameters, buffers and optimizer state, as this rank (its writer) holds them."""
    def copy(value: Any) -> Any:
        return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value

    params = {name: p for name, p in local.params.items() if local.groups[name] == gpus}
    state = {} if optimizer is None else {
        name: {key: copy(value) for key, value in optimizer.state[p].items()}
        for name, p in params.items() if p in optimizer.state
    }
    return GroupShard(
        gpus=gpus,
        params={name: copy(p) for name, p in params.items()},
        buffers={name: copy(b) for name, b in local.buffers.items() if local.groups[name] == gpus},
        optimizer=state,
    )


def _adaptation_state(parts: EngineParts) -> dict[str, Any] | None:
    """The noise scale's moving averages and AdaScale's τ and gain, for a resume to continue them (rank 0
    writes the run state, and rank 0 holds the averages; τ is the same on every rank)."""
    state: dict[str, Any] = {}
    if parts.monitor is not None:
        state["gns"] = parts.monitor.state_dict()
    if parts.lr_scaling is not None:
        state["adascale"] = parts.lr_scaling.state_dict()
    return state or None


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


def _stop_asked(config: RunConfig, comm: Comm) -> bool:
    """Whether the run's ``--stop-file`` is there, as every rank agrees (the maximum over the ranks of what
    each sees now, so all stop after the same step); False without one, with no collective."""
    checkpoint = config.checkpoint
    if checkpoint is None or checkpoint.stop_file is None:
        return False
    return comm.all_reduce_max(1.0 if checkpoint.stop_file.exists() else 0.0) > 0


def _stopped(config: RunConfig, done: int, rank: int) -> None:
    """Rank 0 says the run stopped resumably (``<out>/stopped.json``), after its checkpoint is written."""
    checkpoint = config.checkpoint
    if rank != 0 or config.out_dir is None or checkpoint is None:
        return
    write_json(config.out_dir / STOPPED, {"steps_done": done, "checkpoint": str(checkpoint.directory),
                                          "at": time.time()})


def _epoch_ends(adapter: Adapter, feed: Feed, start: int, end: int, done: int, steps: int) -> bool:
    """Call ``after_epoch`` when the step (global batches ``start..end``) finished a pass over the dataset
    (synthetic data and loaders have no epochs here: when the run ends)."""
    length = feed.order.per_epoch if feed.order is not None else None
    ended = end // length > start // length if length else done == steps
    return adapter.after_epoch(done) if ended else False


def _adapter(plan: Plan, program: Program, comm: Comm, recorder: Recorder, engine: Engine, config: RunConfig,
             progress: Progress, policy: AdaptationPolicy | None) -> Adapter:
    log = EventLog(out_dir=config.out_dir, show=_show) if comm.rank == 0 else None
    steps = StepLog(out_dir=config.out_dir) if comm.rank == 0 and config.out_dir is not None else None
    monitor = StepMonitor(plan, program.stages, comm, recorder, every=config.monitor_every)
    adapter = Adapter(monitor=monitor, policy=policy, progress=progress,
                      gpus=plan.gpus, global_batch=plan.global_batch, optimizer=engine.parts.optimizer,
                      scheduler=engine.parts.scheduler, log=log,
                      on_accumulate=lambda k: _accumulating(engine, plan, comm.rank, k),
                      on_lr=lambda lr: _base_lr(engine, lr), steps=steps)
    if progress.accumulate != config.training.accumulate:
        _accumulating(engine, plan, comm.rank, progress.accumulate)  # resumed after a policy changed K
    _base_lr(engine, progress.lr)
    return adapter


def _base_lr(engine: Engine, lr: float) -> None:
    """AdaScale sets the LR itself each step from its base LR: a policy's LR becomes that base."""
    if engine.parts.lr_scaling is not None:
        engine.parts.lr_scaling.lr = lr


def _accumulating(engine: Engine, plan: Plan, rank: int, micros: int) -> None:
    """``K`` is now ``micros``: the noise-scale monitor measures on ``K·n_r`` and ``K·B`` samples."""
    if engine.parts.lr_scaling is not None:
        raise DeeppoolError("a policy changed the accumulation under --lr-scaling adascale, whose scale is fixed "
                            "at the start: run the policy without --lr-scaling adascale")
    if engine.parts.monitor is not None:
        engine.parts.monitor.shares = group_shares(plan, engine.parts.model.graph, rank, micros)


def _show(message: str) -> None:
    console().print(message, highlight=False, markup=False)


class ModelBuilder:
    """Builds and traces models; both touch process-global state (the RNG, fx's patching),
    so ranks that share one process (tests) substitute a serialised builder."""

    def load(self, spec: ModelSpec) -> LoadedModel:
        return load_model(spec)

    def trace(self, loaded: LoadedModel) -> Traced:
        return trace(loaded)

    def copy(self, loaded: LoadedModel, spec: ModelSpec) -> LoadedModel:
        """A model equal to ``loaded``, as freshly built from ``spec`` (``--check``'s reference): a deep copy,
        or, for a module that cannot be copied (one holding a tensor computed from its parameters), built
        again."""
        try:
            module = copy.deepcopy(loaded.module)
        except (RuntimeError, TypeError):
            return self.load(spec)
        return dataclasses.replace(loaded, module=module)


@dataclass(frozen=True)
class Feed:
    """Where a rank's batches come from: ``batches`` (its rows), ``whole`` (all rows, for ``--check``;
    None when ``batches`` already are whole global batches) and the epoch order of a dataset."""

    batches: BatchSource
    whole: BatchSource | None = None
    order: EpochOrder | None = None
    factory: str = ""

    def report(self, position: int) -> DataReport | None:
        order = self.order
        if order is None:
            return None
        return DataReport(factory=self.factory, samples=order.length, seed=order.seed,
                          batches_per_epoch=order.per_epoch, batches_trained=position)


def _feed(loaded: LoadedModel, plan: Plan, traced: Traced, rank: int, data: Iterable[Any] | torch.utils.data.Dataset
          | None, config: RunConfig) -> Feed:
    spec = config.data
    if data is None and spec is not None:
        data = load_dataset(spec.factory)
    if data is None:
        return Feed(SyntheticBatches(loaded, plan.global_batch))
    if not isinstance(data, torch.utils.data.Dataset):
        return Feed(LoaderBatches(data, plan.global_batch, loaded))
    seed, workers = (spec.seed, spec.workers) if spec is not None else (0, 0)
    order = EpochOrder(length=len(data), global_batch=plan.global_batch, seed=seed)  # type: ignore[arg-type]
    spans = needed_rows(plan, traced.graph, rank)
    whole = ((0, plan.global_batch),)
    return Feed(DatasetBatches(data, order, spans, loaded, workers), DatasetBatches(data, order, whole, loaded),
                order, spec.factory if spec is not None else type(data).__name__)


def _precision(config: RunConfig, module: torch.nn.Module, traced: Traced, loaded: LoadedModel, device: torch.device,
               comm: Comm) -> MixedPrecision:
    """Autocast, the dtypes it gives each layer's output (for reshard buffers) and the fp16 scaler."""
    if config.precision is Precision.FP32:
        return MixedPrecision.fp32()
    dtypes = output_dtypes(module, traced.graph, loaded.named_inputs(2), config.precision, device)
    scaler = AgreedScaler(config.loss_scaling, comm) if config.precision.scaled else None
    return MixedPrecision(config.precision, device, dtypes, scaler)


def _training(traced: Traced) -> torch.nn.Module:
    """The traced module in training mode (an exported graph was captured in it and has no mode)."""
    if traced.graph.method is TraceMethod.FX:
        traced.module.train()
    return traced.module


def _group_sum(comm: Comm, ranks: tuple[int, ...], recorder: Recorder) -> Reduce:
    """Synchronised BatchNorm's sum over ``ranks``, on its own lane (never behind a gradient bucket),
    recorded as communication (inside its stage's compute span)."""

    def reduce(tensor: torch.Tensor) -> None:
        with recorder.span(recorder.step, f"syncbn:{len(ranks)} ranks", Category.COMM):
            comm.all_reduce(tensor, ranks, lane=Lane.STATISTICS)

    return reduce


def _engine(
    plan: Plan, program: Program, local: LocalModel, comm: Comm, loaded: LoadedModel, config: RunConfig,
    recorder: Recorder, on_idle: IdleListener | None, device: torch.device, reference: LockstepReference | None,
    precision: MixedPrecision, slowdown: Slowdown | None, gpu: Gpu | None,
) -> Engine:
    optimizer = config.optimizer.build(local.params.values()) if local.params else None
    training = config.training
    monitor = _monitor(plan, local, comm, config, device)
    scaling = _lr_scaling(plan, config, monitor)
    shares = group_shares(plan, local.graph, comm.rank, training.accumulate)
    return Engine(
        EngineParts(
            plan=plan,
            program=program,
            model=local,
            comm=comm,
            loss=loaded.loss,
            optimizer=optimizer,
            scheduler=training.schedule.build(optimizer) if optimizer is not None and scaling is None else None,
            clip_norm=training.clip_norm,
            reducer=GradientReducer(comm, config.bucket_bytes, side_stream(gpu, device),
                                    first_bucket_bytes=FIRST_BUCKET_BYTES if gpu is not None else None,
                                    meter=None if monitor is None else monitor.meter,
                                    combine=config.adaptation.combine or plan.combine,
                                    scales={share.ranks: share.scale for share in shares}),
            recorder=recorder,
            idle=idle_positions(program, plan.idle_windows(comm.rank)),
            on_idle=on_idle or NoBackground(),
            pace=pace_group(plan) if on_idle is not None else None,
            device=device,
            on_gradients=None if reference is None else reference.gradients_reduced,
            overlap=config.bucket_bytes > 0,
            synchronize=synchronizer(gpu, device),
            monitor=monitor,
            lr_scaling=scaling,
            preconditioner=_preconditioner(plan, local, comm, config, optimizer, precision),
            precision=precision,
            slowdown=slowdown,
        )
    )


def _preconditioner(plan: Plan, local: LocalModel, comm: Comm, config: RunConfig,
                    optimizer: torch.optim.Optimizer | None, precision: MixedPrecision) -> KFACPreconditioner | None:
    """K-FAC over the rank's ``Linear`` and ``Conv2d`` modules, each in its layer's group (``--optimizer kfac``);
    KL clipping reads the optimizer's current learning rate."""
    if config.optimizer.kind is not Optimizer.KFAC:
        return None
    lr = config.optimizer.lr if optimizer is None else (lambda _: float(optimizer.param_groups[0]["lr"]))
    scaler = precision.scaler
    return KFACPreconditioner(local.module, config.optimizer.kfac, lr=lr,
                              groups=kfac_groups(plan, local.graph, local.module, comm.rank), collectives=comm,
                              grad_scaler=None if scaler is None else lambda: scaler.scale)


def _monitor(plan: Plan, local: LocalModel, comm: Comm, config: RunConfig,
             device: torch.device) -> GradientMonitor | None:
    if not config.adaptation.measures:
        return None
    shares = group_shares(plan, local.graph, comm.rank, config.training.accumulate)
    return GradientMonitor(comm, shares, skipped=single_groups(plan, local.graph), device=device)


def _lr_scaling(plan: Plan, config: RunConfig, monitor: GradientMonitor | None) -> AdaScaleLr | None:
    adaptation = config.adaptation
    if adaptation.lr_scaling is not LrScaling.ADASCALE or monitor is None:
        return None
    scaler = AdaScale(base_batch=adaptation.base_batch or default_base_batch(plan),
                      batch=plan.global_batch * config.training.accumulate,
                      adam=config.optimizer.kind is Optimizer.ADAM)
    return AdaScaleLr(scaler, lr=config.optimizer.lr, schedule=config.training.schedule, monitor=monitor)
