"""The executor's command line: ``deeppool run`` (launcher) and the per-rank worker.

``app`` holds the ``run`` command, which the main CLI mounts as ``deeppool run``
(and :func:`profile_network` as ``deeppool profile-network``);
``worker_app`` is what ``python -m deeppool.executor plan.json`` runs on every
rank under torchrun. Both take the same run options.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from deeppool.errors import DeeppoolError
from deeppool.executor.checkpoint import CheckpointConfig
from deeppool.executor.comm import Backend
from deeppool.executor.config import (
    DEFAULT_TIMEOUT_S, OptimizerConfig, OptimizerKind, RunConfig, Schedule, ScheduleKind, Training,
)
from deeppool.executor.netprobe import DEFAULT_SIZES, ProbeConfig, probe_network
from deeppool.executor.report import fit_table
from deeppool.executor.worker import RankEnv, report_failure, run_worker
from deeppool.multiplex.api import launch_with_background
from deeppool.multiplex.config import MuxMode
from deeppool.multiplex.options import (
    AbBlock, BackgroundOpt, BgBatch, BgCheckpointDir, BgLr, BgOptim, MpsPercentage, MuxOpt, SlowdownTarget,
    make_background,
)
from deeppool.planner.plan import Plan

PlanArg = Annotated[Path, typer.Argument(help="plan JSON written by `deeppool plan`")]
Steps = Annotated[int, typer.Option(help="training iterations")]
Warmup = Annotated[int, typer.Option(help="iterations left out of the timing medians")]
Optim = Annotated[OptimizerKind | None, typer.Option("--optimizer", help="optimizer (default: the plan's)")]
Lr = Annotated[float, typer.Option(help="learning rate")]
Momentum = Annotated[float, typer.Option(help="SGD momentum")]
BackendOpt = Annotated[Backend, typer.Option(help="auto: NCCL with CUDA, else gloo")]
Timeout = Annotated[float, typer.Option("--timeout", help="seconds before a stalled communication fails")]
BucketMb = Annotated[float, typer.Option(help="gradient bucket size in MiB (0: per layer, synchronous)")]
Check = Annotated[bool, typer.Option(
    "--check", help="also train one process in lockstep; compare gradients, buffers and parameters every step"
)]
CheckBound = Annotated[float, typer.Option(
    help="largest relative difference --check accepts (per tensor: gradients and buffers against their own norm, "
    "parameters against their module's scale; fp32 round-off stays under 5e-5)"
)]
Out = Annotated[Path, typer.Option("--out", help="directory for traces, summary.json and error records")]
Accumulate = Annotated[int, typer.Option(help="global batches whose gradients are summed per optimizer step")]
ClipNorm = Annotated[float | None, typer.Option(help="clip gradients to this global L2 norm (whole model)")]
LrSchedule = Annotated[ScheduleKind, typer.Option(help="learning rate after warm-up: constant, or decaying to 0")]
LrWarmup = Annotated[int, typer.Option(help="optimizer steps of linear learning-rate warm-up")]
CheckpointDir = Annotated[Path | None, typer.Option(help="directory for checkpoints (one shard per rank)")]
CheckpointEvery = Annotated[int, typer.Option(help="write a checkpoint every N optimizer steps (0: never)")]
Resume = Annotated[bool, typer.Option("--resume", help="continue from the latest complete checkpoint")]

app = typer.Typer(add_completion=False, help="Run a plan on torch.distributed.")
worker_app = typer.Typer(add_completion=False, help="One rank of a plan (start it with torchrun).")


@app.callback()
def _group() -> None:
    """Run a plan on torch.distributed."""


def make_config(
    *, steps: int, warmup: int, optimizer: OptimizerKind, lr: float, momentum: float, backend: Backend,
    timeout: float, bucket_mb: float, check: bool, check_bound: float, out: Path, accumulate: int = 1,
    clip_norm: float | None = None, lr_schedule: ScheduleKind = ScheduleKind.CONSTANT, lr_warmup: int = 0,
    checkpoint_dir: Path | None = None, checkpoint_every: int = 0, resume: bool = False,
) -> RunConfig:
    training = Training(
        accumulate=accumulate, clip_norm=clip_norm,
        schedule=Schedule(kind=lr_schedule, warmup_steps=lr_warmup, total_steps=steps),
    )
    return RunConfig(
        steps=steps, warmup=min(warmup, max(steps - 1, 0)),
        optimizer=OptimizerConfig(kind=optimizer, lr=lr, momentum=momentum),
        backend=backend, timeout_s=timeout, bucket_mb=bucket_mb, check=check, check_bound=check_bound, out_dir=out,
        training=training,
        checkpoint=CheckpointConfig(directory=checkpoint_dir, every=checkpoint_every, resume=resume)
        if checkpoint_dir is not None else None,
    )


def config_args(config: RunConfig) -> list[str]:
    """The worker's command-line options for ``config``."""
    args = [
        "--steps", str(config.steps), "--warmup", str(config.warmup),
        "--optimizer", config.optimizer.kind.value, "--lr", repr(config.optimizer.lr),
        "--momentum", repr(config.optimizer.momentum), "--backend", config.backend.value,
        "--timeout", repr(config.timeout_s), "--bucket-mb", repr(config.bucket_mb),
        "--check-bound", repr(config.check_bound), "--out", str(config.out_dir),
        "--accumulate", str(config.training.accumulate), "--lr-schedule", config.training.schedule.kind.value,
        "--lr-warmup", str(config.training.schedule.warmup_steps),
    ]
    clip, checkpoint = config.training.clip_norm, config.checkpoint
    if clip is not None:
        args += ["--clip-norm", repr(clip)]
    if checkpoint is not None:
        args += ["--checkpoint-dir", str(checkpoint.directory), "--checkpoint-every", str(checkpoint.every)]
        args += ["--resume"] if checkpoint.resume else []
    return args + (["--check"] if config.check else [])


@app.command()
def run(
    plan: PlanArg,
    nproc: Annotated[int | None, typer.Option(help="ranks to start here (default: the plan's GPU count)")] = None,
    steps: Steps = 50, warmup: Warmup = 5, optimizer: Optim = None, lr: Lr = 0.01,
    momentum: Momentum = 0.0, backend: BackendOpt = Backend.AUTO, timeout: Timeout = DEFAULT_TIMEOUT_S,
    bucket_mb: BucketMb = 25.0, check: Check = False, check_bound: CheckBound = 1e-3,
    out: Out = Path("deeppool-run"), accumulate: Accumulate = 1, clip_norm: ClipNorm = None,
    lr_schedule: LrSchedule = ScheduleKind.CONSTANT, lr_warmup: LrWarmup = 0, checkpoint_dir: CheckpointDir = None,
    checkpoint_every: CheckpointEvery = 0, resume: Resume = False,
    background: BackgroundOpt = None, bg_batch: BgBatch = 8, bg_optimizer: BgOptim = OptimizerKind.SGD,
    bg_lr: BgLr = 0.01, mux: MuxOpt = MuxMode.GATE, slowdown_target: SlowdownTarget = 0.05, ab_block: AbBlock = 4,
    bg_checkpoint_dir: BgCheckpointDir = None, mps_percentage: MpsPercentage = 30,
) -> None:
    """Train with PLAN on --nproc local ranks (torchrun underneath) and print the timing summary."""
    loaded = Plan.load(plan)
    config = make_config(
        steps=steps, warmup=warmup, optimizer=optimizer or plan_optimizer(loaded), lr=lr, momentum=momentum,
        backend=backend, timeout=timeout, bucket_mb=bucket_mb, check=check, check_bound=check_bound, out=out,
        accumulate=accumulate, clip_norm=clip_norm, lr_schedule=lr_schedule, lr_warmup=lr_warmup,
        checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, resume=resume,
    )
    bg = make_background(
        background=background, bg_batch=bg_batch, bg_optimizer=bg_optimizer, bg_lr=bg_lr, mux=mux,
        slowdown_target=slowdown_target, ab_block=ab_block, bg_checkpoint_dir=bg_checkpoint_dir,
        mps_percentage=mps_percentage, out=out,
    )
    ranks = nproc if nproc is not None else loaded.gpus
    launch_with_background(plan, nproc=ranks, config=config, background=bg, worker_args=config_args(config))


def plan_optimizer(plan: Plan) -> OptimizerKind:
    """The optimizer the plan was made for (its memory and step time assume it)."""
    return OptimizerKind(plan.optimizer.value)


def profile_network(
    out: Annotated[Path, typer.Option(help="where to write the network JSON (for `deeppool plan --network-file`)")],
    nproc: Annotated[int, typer.Option(help="processes to measure with (the ranks a plan will run)")] = 2,
    sizes: Annotated[str, typer.Option(help="message sizes in bytes, comma-separated")] = ",".join(
        str(size) for size in DEFAULT_SIZES
    ),
    repeats: Annotated[int, typer.Option(help="timed runs per size (median taken)")] = 10,
    warmup: Annotated[int, typer.Option(help="untimed runs per size")] = 3,
) -> None:
    """Measure gloo all-reduce and point-to-point here and fit the cost model's latency and bandwidth."""
    config = ProbeConfig(nproc=nproc, sizes=_sizes(sizes), repeats=repeats, warmup=warmup)
    fitted = probe_network(config)
    fitted.save(out)
    console = Console()
    console.print(fit_table(fitted))
    console.print(
        f"fitted: latency {fitted.latency_s * 1e6:.1f} us, bandwidth {fitted.bandwidth / 1e9:.3f} GB/s "
        f"({nproc} gloo processes); network written to {out}",
        highlight=False,
    )


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise DeeppoolError(f"--sizes '{text}' is not comma-separated integers (bytes), e.g. 4096,1048576") from None


@worker_app.command()
def worker(
    plan: PlanArg, steps: Steps = 50, warmup: Warmup = 5, optimizer: Optim = None, lr: Lr = 0.01,
    momentum: Momentum = 0.0, backend: BackendOpt = Backend.AUTO, timeout: Timeout = DEFAULT_TIMEOUT_S,
    bucket_mb: BucketMb = 25.0, check: Check = False, check_bound: CheckBound = 1e-3,
    out: Out = Path("deeppool-run"), accumulate: Accumulate = 1, clip_norm: ClipNorm = None,
    lr_schedule: LrSchedule = ScheduleKind.CONSTANT, lr_warmup: LrWarmup = 0, checkpoint_dir: CheckpointDir = None,
    checkpoint_every: CheckpointEvery = 0, resume: Resume = False,
    background: BackgroundOpt = None, bg_batch: BgBatch = 8, bg_optimizer: BgOptim = OptimizerKind.SGD,
    bg_lr: BgLr = 0.01, mux: MuxOpt = MuxMode.GATE, slowdown_target: SlowdownTarget = 0.05, ab_block: AbBlock = 4,
    bg_checkpoint_dir: BgCheckpointDir = None, mps_percentage: MpsPercentage = 30,
) -> None:
    """Run this process's rank of PLAN (rank and world from torchrun's environment)."""
    env = RankEnv.from_environ()
    try:
        config = make_config(
            steps=steps, warmup=warmup, optimizer=optimizer or plan_optimizer(Plan.load(plan)), lr=lr,
            momentum=momentum, backend=backend, timeout=timeout, bucket_mb=bucket_mb, check=check,
            check_bound=check_bound, out=out, accumulate=accumulate, clip_norm=clip_norm, lr_schedule=lr_schedule,
            lr_warmup=lr_warmup, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, resume=resume,
        )
        bg = make_background(
            background=background, bg_batch=bg_batch, bg_optimizer=bg_optimizer, bg_lr=bg_lr, mux=mux,
            slowdown_target=slowdown_target, ab_block=ab_block, bg_checkpoint_dir=bg_checkpoint_dir,
            mps_percentage=mps_percentage, out=out,
        )
        run_worker(plan, config, env, bg)
    except BaseException as err:  # every failure leaves a record naming this rank
        if isinstance(err, (SystemExit, typer.Exit)):
            raise
        kind = report_failure(err, env, out)
        raise SystemExit(kind.value) from None


def main() -> None:
    """Standalone entry (``python -m deeppool.executor.cli run ...``): user errors as one line, exit 2."""
    try:
        app(standalone_mode=False)
    except DeeppoolError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(getattr(err, "exit_code", 2)) from None
    except typer.Abort:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
