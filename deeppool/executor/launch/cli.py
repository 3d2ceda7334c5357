"""The executor's command-line pieces: the run options, their checks, and two commands of its own.

The options (``PlanArg``, ``Steps``, ...) and :func:`make_config` are what ``deeppool run`` and its ranks'
worker (:mod:`deeppool.run_command`, which wires the multiplexer in) take; :func:`profile_network` is
``deeppool profile-network`` and :func:`export` is ``deeppool export``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from deeppool import checks
from deeppool.errors import DeeppoolError
from deeppool.interrupt import removed_if_interrupted
from deeppool.executor.launch.worker_args import config_args
from deeppool.executor.config import (
    DEFAULT_SIZES, Adaptation, Backend, BatchNormMode, CheckpointConfig, DataConfig, LossScaling, LrScaling,
    Monitor, Nodes, OptimizerConfig, OptimizerKind, Precision, ProbeConfig, RunConfig, Schedule, ScheduleKind,
    Training,
)
from deeppool.planner.combine import Combine

if TYPE_CHECKING:
    from deeppool.planner.plan import Plan

PlanArg = Annotated[Path, typer.Argument(help="plan JSON written by `deeppool plan`")]
Steps = Annotated[int, typer.Option(help="training iterations, warm-up included")]
Warmup = Annotated[int | None, typer.Option(
    help="the first iterations, left out of the timing medians (fewer than --steps)",
    show_default="5, or --steps - 1 when --steps is 5 or less")]
Optim = Annotated[OptimizerKind | None, typer.Option("--optimizer", help="optimizer", show_default="the plan's")]
Lr = Annotated[float, typer.Option(help="learning rate")]
Momentum = Annotated[float, typer.Option(help="SGD momentum")]
BackendOpt = Annotated[Backend, typer.Option(help="auto: NCCL with CUDA, else gloo")]
Timeout = Annotated[float, typer.Option("--timeout", help="seconds before a stalled communication fails")]
BucketMb = Annotated[float, typer.Option(help="gradient bucket size in MiB (0: per stage, synchronous)")]
Check = Annotated[bool, typer.Option(
    "--check", help="also train one process in lockstep; compare gradients, buffers and parameters every step"
)]
CheckBound = Annotated[float | None, typer.Option(
    help="largest relative difference --check accepts (per tensor: gradients and buffers against their own norm, "
    "parameters against their module's scale; measured fp32 round-off after a few steps: about 1e-6 on "
    "transformers, up to 7e-5 on deep BatchNorm CNNs such as densenet121, and it grows with depth and steps)",
    show_default="1e-3 (fp32), 1e-2 (fp16), 5e-2 (bf16)",
)]
Out = Annotated[Path, typer.Option("--out", help="directory for traces, summary.json and error records")]
NNodes = Annotated[int, typer.Option("--nnodes", help="machines the run spans (the same command on each)")]
RdzvEndpoint = Annotated[str | None, typer.Option(
    "--rdzv-endpoint", help="HOST:PORT where the machines meet (with --nnodes > 1), as torchrun's")]
RdzvId = Annotated[str | None, typer.Option("--rdzv-id", help="the run's id, the same on every machine")]
ModelOpt = Annotated[str | None, typer.Option(
    "--model", help="rebuild the model from this file or package.module:factory instead of the plan's "
    "(the plan's input shape and seed are kept)", show_default="the plan's, relative to the plan file")]
Accumulate = Annotated[int, typer.Option(help="global batches whose gradients are summed per optimizer step")]
ClipNorm = Annotated[float | None, typer.Option(help="clip gradients to this global L2 norm (whole model)")]
LrSchedule = Annotated[ScheduleKind, typer.Option(help="learning rate after warm-up: constant, or decaying to 0")]
LrWarmup = Annotated[int, typer.Option(help="optimizer steps of linear learning-rate warm-up")]
CheckpointDir = Annotated[Path | None, typer.Option(help="directory for checkpoints (one shard per layer group)")]
CheckpointEvery = Annotated[int, typer.Option(help="write a checkpoint every N optimizer steps (0: never)")]
Resume = Annotated[bool, typer.Option("--resume", help="continue from the latest complete checkpoint")]
MonitorEvery = Annotated[int, typer.Option(
    help="steps per all-gather of the ranks' step and compute times (stragglers, policies' snapshots)")]
PolicyOpt = Annotated[str | None, typer.Option(
    "--policy", help="adapt the run: grow-batch (grow the batch by accumulation while the noise scale says it "
    "pays; needs --monitor gns), or module:factory / file.py:factory returning a policy")]
MonitorOpt = Annotated[Monitor, typer.Option(
    "--monitor", help="gns: measure the gradient noise scale per layer group (summary.json 'gns', a trace counter)")]
LrScalingFlag = Annotated[LrScaling, typer.Option(
    "--lr-scaling", help="adascale: scale the LR by AdaScale's gain (measures the noise scale), schedule by τ")]
BaseBatch = Annotated[int | None, typer.Option(
    "--base-batch", help="AdaScale's base batch, the batch --lr is tuned for",
    show_default="global batch / the widest layer's GPUs")]
StepBatch = Annotated[int | None, typer.Option(
    "--batch", help="samples per optimizer step: a multiple of the plan's global batch, trained as that many "
    "micro-batches (--accumulate)", show_default="the plan's global batch x --accumulate")]
CombineOpt = Annotated[Combine | None, typer.Option(
    "--combine", help="how a layer group combines gradients: sum (the mean gradient) or adasum",
    show_default="the plan's")]
PrecisionOpt = Annotated[Precision, typer.Option(
    "--precision", help="forward under autocast to bf16 or fp16 (fp16 with loss scaling); weights stay fp32")]
LossScale = Annotated[float, typer.Option("--loss-scale", help="fp16: the initial loss scale")]
DataOpt = Annotated[str | None, typer.Option(
    "--data", help="train on the map-style Dataset this returns (package.module:factory or file.py:factory); "
    "each rank loads only its rows", show_default="the model's synthetic batch")]
DataSeed = Annotated[int, typer.Option("--data-seed", help="seed of the per-epoch sample order (seed + epoch)")]
DataWorkers = Annotated[int, typer.Option("--data-workers", help="DataLoader worker processes per rank")]
TensorboardOpt = Annotated[Path | None, typer.Option(
    "--tensorboard", help="write loss, throughput, GNS and background work as TensorBoard scalars here, live "
    "(every --monitor-every steps; needs the tensorboard package)")]
ScriptOpt = Annotated[Path | None, typer.Option(
    "--script", help="run this training script on every rank instead (it calls deeppool.parallelize; "
    "$DEEPPOOL_PLAN names the plan): see docs/library.md")]
ScriptArgs = Annotated[list[str] | None, typer.Option("--script-arg", help="an argument for --script (repeat it)")]
BatchNormOpt = Annotated[BatchNormMode, typer.Option(
    "--batchnorm", help="BatchNorm statistics of a layer on several ranks: sync (the whole batch's, exact to one "
    "process) or local (each rank's own samples, as DDP with nn.BatchNorm; not exact, refused with --check)")]
DEFAULT_WARMUP = 5
CPU_RANKS_PER_CORE = 4
"""gloo ranks on CPU share the cores; beyond this many per core a run measures only contention."""


def make_config(
    *, steps: int, warmup: int | None, optimizer: OptimizerKind, lr: float, momentum: float, backend: Backend,
    timeout: float, bucket_mb: float, check: bool, check_bound: float | None, out: Path, accumulate: int = 1,
    clip_norm: float | None = None, lr_schedule: ScheduleKind = ScheduleKind.CONSTANT, lr_warmup: int = 0,
    checkpoint_dir: Path | None = None, checkpoint_every: int = 0, resume: bool = False,
    monitor: Monitor = Monitor.NONE, lr_scaling: LrScaling = LrScaling.NONE, base_batch: int | None = None,
    combine: Combine | None = None,
    precision: Precision = Precision.FP32, loss_scale: float = LossScaling().initial, data: str | None = None,
    data_seed: int = 0, data_workers: int = 0,
    policy: str | None = None, monitor_every: int = 10,
    batchnorm: BatchNormMode = BatchNormMode.SYNC,
) -> RunConfig:
    """The run's config; ``warmup=None`` is the default: 5, or one less than ``steps`` when that is fewer."""
    if warmup is not None and steps >= 1 and warmup >= steps:
        raise DeeppoolError(
            f"--warmup {warmup} must be less than --steps {steps}: the warm-up iterations are not timed, "
            f"so at least one must remain (e.g. --warmup {max(steps - 1, 0)})"
        )
    training = Training(
        accumulate=accumulate, clip_norm=clip_norm,
        schedule=Schedule(kind=lr_schedule, warmup_steps=lr_warmup, total_steps=max(steps, 1)),
    )
    return RunConfig(
        steps=steps, warmup=min(DEFAULT_WARMUP, max(steps - 1, 0)) if warmup is None else warmup,
        optimizer=OptimizerConfig(kind=optimizer, lr=lr, momentum=momentum),
        backend=backend, timeout_s=timeout, bucket_mb=bucket_mb, check=check, check_bound=check_bound, out_dir=out,
        training=training,
        checkpoint=CheckpointConfig(directory=checkpoint_dir, every=checkpoint_every, resume=resume)
        if checkpoint_dir is not None else None,
        adaptation=Adaptation(monitor=monitor, lr_scaling=lr_scaling, base_batch=base_batch, combine=combine),
        precision=precision, loss_scaling=LossScaling(initial=loss_scale),
        data=DataConfig(factory=_located(DataConfig(factory=data).factory), seed=data_seed, workers=data_workers)
        if data is not None else None,
        policy=policy, monitor_every=monitor_every,
        batchnorm=batchnorm,
    )


def _located(factory: str) -> str:
    """A ``file.py:factory`` made absolute, so ranks started elsewhere find it."""
    location, _, attr = factory.rpartition(":")
    if not location.endswith(".py"):
        return factory
    if not Path(location).is_file():
        raise DeeppoolError(f"--data '{factory}': no file '{location}' (give path/to/data.py:factory)")
    return f"{Path(location).resolve()}:{attr}"


def run_script(plan: Plan, plan_path: Path, script: Path, args: list[str], *, ranks: int, out: Path,
               timeout: float, nodes: Nodes) -> None:
    """``--script``: the user's training script on every rank, as torchrun would start it."""
    from deeppool.executor.launch.launch import launch

    checks.existing_file(script, "--script")
    launch(plan, plan_path, nproc=ranks, config=RunConfig(out_dir=out, timeout_s=timeout), worker_args=args,
           nodes=nodes, script=script)


def resized(plan: Plan, config: RunConfig, request: dict[str, object], model: str | None) -> Path:
    """A policy asked for another GPU count: plan for it next to the checkpoint and print how to resume."""
    import dataclasses
    import shlex

    from deeppool.executor.launch.netprobe import probed_source
    from deeppool.output import console
    from deeppool.planner.api import plan_model
    from deeppool.planner.hardware import KnownDevice
    from deeppool.planner.request import LOCAL, CostSource, PlanRequest

    gpus, checkpoint = int(str(request["gpus"])), Path(str(request["checkpoint"]))
    device = plan.device if plan.device in {known.value for known in KnownDevice} else LOCAL
    planned = plan_model(plan.model, PlanRequest(gpus=gpus, global_batch=plan.global_batch, strategy=plan.strategy,
                                                 optimizer=plan.optimizer, amplification=plan.amplification_limit),
                         probed_source(CostSource(device_model=device, show_progress=False), gpus,
                                       lambda line: console().print(line, highlight=False))).plan
    path = checkpoint / f"plan-{gpus}gpus.json"
    planned.save(path)
    every = config.checkpoint.every if config.checkpoint is not None else 0
    resumed = dataclasses.replace(config, checkpoint=CheckpointConfig(directory=checkpoint, every=every, resume=True))
    command = ["deeppool", "run", str(path), "--nproc", str(gpus), *config_args(resumed)]
    command += ["--model", model] if model is not None else []
    shown = console()
    shown.print(f"the policy asked for {gpus} GPUs after step {request['steps_done']}: checkpoint in {checkpoint}, "
                f"plan for {gpus} GPUs written to {path}; resume with:", highlight=False, markup=False)
    shown.print(shlex.join(command), highlight=False, markup=False, soft_wrap=True)
    return path


def micro_batches(plan: Plan, batch: int | None, accumulate: int) -> int:
    """``--accumulate``, or the micro-batches that make ``--batch`` samples per step out of the plan's batch."""
    if batch is None:
        return accumulate
    if accumulate != 1:
        raise DeeppoolError(f"--batch {batch} sets the micro-batches per step: drop --accumulate {accumulate}")
    if batch < 1 or batch % plan.global_batch != 0:
        multiple = max(1, round(batch / plan.global_batch)) * plan.global_batch
        raise DeeppoolError(f"--batch {batch} is not a multiple of the plan's global batch {plan.global_batch}: "
                            f"give a multiple (e.g. --batch {multiple}), or re-plan with --batch {batch}")
    return batch // plan.global_batch


def check_model_here(plan: Plan, path: Path) -> None:
    """The plan's model can be rebuilt here, or the one line says to give --model."""
    from deeppool.planner.modelspec import ModelSource

    spec = plan.model
    if spec.source is ModelSource.PYTHON:
        raise DeeppoolError(f"plan '{path}' was made from a module built in Python ('{spec.location}'): "
                            "give --model model.py (or package.module:factory) to rebuild it")
    if spec.source in (ModelSource.FILE, ModelSource.SAVED) and not Path(spec.location).is_file():
        raise DeeppoolError(f"plan '{path}' names model '{spec.location}', which is not here: "
                            "give --model PATH to the model file on this machine")


def check_ranks(ranks: int, plan: Plan, *, given: bool, nodes: int = 1) -> None:
    """The ranks match the plan and fit this machine: one GPU each, or a few per CPU core."""
    flag = "--nproc" if given else f"the plan's {plan.gpus} GPUs (--nproc's default)"
    if ranks < 1:
        raise DeeppoolError(f"--nproc {ranks} must be at least 1")
    if nodes > 1 and ranks * nodes != plan.gpus:
        raise DeeppoolError(f"--nproc {ranks} on each of --nnodes {nodes} machines is {ranks * nodes} ranks, but the "
                            f"plan is for {plan.gpus} GPUs: give --nproc x --nnodes = {plan.gpus}")
    if nodes == 1 and ranks != plan.gpus:
        raise DeeppoolError(f"--nproc {ranks} differs from the plan's {plan.gpus} GPUs: use --nproc {plan.gpus} "
                            "or re-plan for this many")
    slots, kind = local_slots()
    if ranks > slots:
        raise DeeppoolError(
            f"{flag}: {ranks} ranks is more than this machine runs ({kind}); "
            f"re-plan for at most {slots} GPUs to run here, or run the plan with torchrun on more machines"
        )


def local_slots() -> tuple[int, str]:
    """How many ranks this machine runs, and why: its CUDA GPUs, else a few gloo ranks per CPU core."""
    from deeppool.device.cuda import CudaGpu

    count = CudaGpu().count()
    if count:
        return count, f"{count} CUDA GPU(s), one rank each"
    cores = os.cpu_count() or 1
    return CPU_RANKS_PER_CORE * cores, f"{cores} CPU core(s), at most {CPU_RANKS_PER_CORE} gloo ranks per core"


def with_model(plan: Plan, model: str, out: Path) -> tuple[Plan, Path]:
    """A copy of ``plan`` whose model is rebuilt from ``model`` (the plan's inputs and seed kept), and the file in
    ``out`` it is saved to."""
    import dataclasses

    from deeppool.planner.modelspec import ModelSpec

    if model.endswith(".py") or Path(model).exists():
        spec = ModelSpec.parse(model, seed=plan.model.seed)  # a model file makes its own inputs
    else:
        spec = ModelSpec.parse(model, input_shape=plan.model.input_shape, input_dtype=plan.model.input_dtype,
                               vocab_size=plan.model.vocab_size, seed=plan.model.seed)
    out.mkdir(parents=True, exist_ok=True)
    path, copy = out / "plan.json", dataclasses.replace(plan, model=spec)
    copy.save(path)
    return copy, path


def plan_optimizer(plan: Plan) -> OptimizerKind:
    """The optimizer the plan was made for (its memory and step time assume it)."""
    return OptimizerKind(plan.optimizer.value)


def profile_network(
    out: Annotated[Path, typer.Option(help="where to write the network JSON (for `deeppool plan --network-file`)")],
    nproc: Annotated[int, typer.Option(help="processes to measure with (the ranks a plan will run)")] = 2,
    sizes: Annotated[str, typer.Option(help="message sizes in bytes, comma-separated")] = ",".join(
        str(size) for size in DEFAULT_SIZES
    ),
    repeats: Annotated[int, typer.Option(help="the fewest timed runs per size (more until each size took 0.4 s; the mean taken)")] = 10,
    warmup: Annotated[int, typer.Option(help="untimed runs per size")] = 3,
) -> None:
    """Measure gloo all-reduce and point-to-point here and fit the cost model's latency and bandwidth."""
    checks.new_file(out, "--out")
    config = ProbeConfig(nproc=nproc, sizes=checks.ints(sizes, "--sizes", "4096,1048576"), repeats=repeats,
                         warmup=warmup)
    cores = os.cpu_count() or 1
    if nproc > CPU_RANKS_PER_CORE * cores:
        raise DeeppoolError(f"--nproc {nproc} is more than {CPU_RANKS_PER_CORE} processes per CPU core "
                            f"({cores} here): the probe would measure contention, not the network")
    with removed_if_interrupted(out):
        _probe(config, out)


def _probe(config: ProbeConfig, out: Path) -> None:
    from deeppool.executor.launch.netprobe import probe_network
    from deeppool.executor.launch.report import fit_table
    from deeppool.output import console

    fitted = probe_network(config)
    fitted.save(out)
    shown = console()
    shown.print(fit_table(fitted))
    shown.print(
        f"fitted: latency {fitted.latency_s * 1e6:.1f} us, bandwidth {fitted.bandwidth / 1e9:.3f} GB/s "
        f"({config.nproc} gloo processes); network written to {out}",
        highlight=False,
    )


def export(
    checkpoint_dir: Annotated[Path, typer.Argument(help="a run's --checkpoint-dir")],
    out: Annotated[Path, typer.Option("--out", help="where to write the state_dict (torch.save)")],
    step: Annotated[int | None, typer.Option(help="the checkpoint after this many optimizer steps",
                                             show_default="the newest complete one")] = None,
    plan: Annotated[Path | None, typer.Option(help="check that the state_dict loads into this plan's model")] = None,
) -> None:
    """Join a checkpoint's layer-group shards into one state_dict of the original, unsplit model."""
    checks.new_file(out, "--out")
    checks.existing_file(plan, "--plan")
    import torch

    from deeppool.executor.training.checkpoint import export as joined
    from deeppool.output import console

    done, state = joined(checkpoint_dir, step, lambda message: print(f"warning: {message}", file=sys.stderr))
    if plan is not None:
        _loads_into(plan, state)
    with removed_if_interrupted(out):
        torch.save(state, out)
    console().print(f"{len(state)} tensors after {done} steps written to {out}"
                    + (f"; they load into {plan}'s model" if plan is not None else ""), highlight=False)


def _loads_into(path: Path, state: dict[str, object]) -> None:
    from deeppool.planner.plan import Plan

    model = Plan.load(path).model.load().module
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        name, what = (missing[0], "has no") if missing else (unexpected[0], "has an unknown")
        raise DeeppoolError(f"the checkpoint {what} tensor '{name}' for the model of plan '{path}': "
                            "export the checkpoint of a run of that plan")
