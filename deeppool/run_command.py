"""``deeppool run`` and its ranks' worker: the executor with the multiplexer wired in.

The one place above both layers where they meet: the executor runs a plan and offers its idle windows
through a :class:`~deeppool.executor.engine.idle.StartLender`; the multiplexer lends them to a background job.
``app`` holds the ``run`` command, which the main CLI mounts as ``deeppool run``; ``worker_app`` is what
``python -m deeppool.executor plan.json`` runs on every rank under torchrun. Both take the same run options
(:mod:`deeppool.executor.launch.cli`) and the background's (:mod:`deeppool.multiplex.options`).
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from deeppool import checks
from deeppool.interrupt import removed_if_interrupted
from deeppool.executor.launch.cli import (
    Accumulate, BackendOpt, BaseBatch, BatchNormOpt, BucketMb, Check, CheckBound, CheckpointDir, CheckpointEvery,
    ClipNorm, CombineOpt, DataOpt, DataSeed, DataWorkers, LossScale, Lr, LrSchedule, LrScalingFlag, LrWarmup,
    ModelOpt, Momentum, MonitorEvery, MonitorOpt, NNodes, Optim, Out, PlanArg, PolicyOpt, PrecisionOpt,
    RdzvEndpoint, RdzvId, Resume, ScriptArgs, ScriptOpt, StepBatch, Steps, TensorboardOpt, Timeout, Warmup,
    check_model_here, check_ranks, make_config, micro_batches, plan_optimizer, resized, run_script, with_model,
)
from deeppool.executor.config import (
    DEFAULT_TIMEOUT_S, Backend, BatchNormMode, LossScaling, LrScaling, Monitor, Nodes, OptimizerKind, Precision,
    RunConfig, ScheduleKind, check_adaptation,
)
from deeppool.executor.training.outputs import RESIZE
from deeppool.executor.launch.worker_args import config_args
from deeppool.multiplex.config import BackgroundConfig, MuxMode
from deeppool.multiplex.options import (
    AbBlock, BackgroundOpt, BgBatch, BgBroker, BgCheckpointDir, BgLr, BgOptim, MpsPercentage, MuxOpt, SlowdownTarget,
    make_background,
)

if TYPE_CHECKING:
    from deeppool.planner.plan import Plan

app = typer.Typer(add_completion=False, help="Run a plan on torch.distributed.")
worker_app = typer.Typer(add_completion=False, help="One rank of a plan (start it with torchrun).")


@app.callback()
def _group() -> None:
    """Run a plan on torch.distributed."""


@app.command()
def run(
    plan: PlanArg,
    nproc: Annotated[int | None, typer.Option(help="ranks to start here", show_default="the plan's GPU count")] = None,
    nnodes: NNodes = 1, rdzv_endpoint: RdzvEndpoint = None, rdzv_id: RdzvId = None,
    model: ModelOpt = None,
    steps: Steps = 50, warmup: Warmup = None, optimizer: Optim = None, lr: Lr = 0.01,
    momentum: Momentum = 0.0, backend: BackendOpt = Backend.AUTO, timeout: Timeout = DEFAULT_TIMEOUT_S,
    bucket_mb: BucketMb = 25.0, check: Check = False, check_bound: CheckBound = None,
    out: Out = Path("deeppool-run"), accumulate: Accumulate = 1, clip_norm: ClipNorm = None,
    lr_schedule: LrSchedule = ScheduleKind.CONSTANT, lr_warmup: LrWarmup = 0, checkpoint_dir: CheckpointDir = None,
    checkpoint_every: CheckpointEvery = 0, resume: Resume = False, monitor: MonitorOpt = Monitor.NONE,
    lr_scaling: LrScalingFlag = LrScaling.NONE, base_batch: BaseBatch = None, combine: CombineOpt = None,
    batch: StepBatch = None, precision: PrecisionOpt = Precision.FP32,
    loss_scale: LossScale = LossScaling().initial, data: DataOpt = None, data_seed: DataSeed = 0,
    data_workers: DataWorkers = 0,
    policy: PolicyOpt = None, monitor_every: MonitorEvery = 10,
    batchnorm: BatchNormOpt = BatchNormMode.SYNC,
    background: BackgroundOpt = None, bg_batch: BgBatch = 8, bg_optimizer: BgOptim = OptimizerKind.SGD,
    bg_lr: BgLr = 0.01, mux: MuxOpt = MuxMode.GATE, slowdown_target: SlowdownTarget = 0.05, ab_block: AbBlock = 4,
    bg_checkpoint_dir: BgCheckpointDir = None, mps_percentage: MpsPercentage = 30,
    script: ScriptOpt = None, script_arg: ScriptArgs = None, tensorboard: TensorboardOpt = None,
) -> None:
    """Train with PLAN on --nproc local ranks (torchrun underneath) and print the timing summary."""
    from deeppool.planner.plan import Plan

    nodes = Nodes(count=nnodes, endpoint=rdzv_endpoint, run_id=rdzv_id)
    checks.existing_file(plan, "plan file")
    checks.out_folder(out, "--out")
    checks.existing_file(background, "--background")
    if bg_checkpoint_dir is not None:
        checks.out_folder(bg_checkpoint_dir, "--bg-checkpoint-dir")
    loaded = Plan.load(plan)
    ranks = nproc if nproc is not None else loaded.gpus // nodes.count
    check_ranks(ranks, loaded, given=nproc is not None, nodes=nodes.count)
    if tensorboard is not None:
        from deeppool.executor.training.tensorboard import check_available

        checks.out_folder(tensorboard, "--tensorboard")
        check_available()
    if script is not None:
        run_script(loaded, plan, script, script_arg or [], ranks=ranks, out=out, timeout=timeout, nodes=nodes)
        return
    config = make_config(
        steps=steps, warmup=warmup, optimizer=optimizer or plan_optimizer(loaded), lr=lr, momentum=momentum,
        backend=backend, timeout=timeout, bucket_mb=bucket_mb, check=check, check_bound=check_bound, out=out,
        accumulate=micro_batches(loaded, batch, accumulate), clip_norm=clip_norm, lr_schedule=lr_schedule,
        lr_warmup=lr_warmup, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, resume=resume,
        monitor=monitor, lr_scaling=lr_scaling, base_batch=base_batch, combine=combine, precision=precision,
        loss_scale=loss_scale, data=data, data_seed=data_seed, data_workers=data_workers, policy=policy,
        monitor_every=monitor_every, batchnorm=batchnorm,
    )
    check_adaptation(loaded, config, grouped=any(layer.gpus > 1 and layer.allreduce_ms > 0 for layer in loaded.layers))
    if policy is not None:
        from deeppool.adaptation.policy import load_policy

        load_policy(policy)  # a wrong --policy is one line here, not one per rank
    bg = make_background(
        background=background, bg_batch=bg_batch, bg_optimizer=bg_optimizer, bg_lr=bg_lr, mux=mux,
        slowdown_target=slowdown_target, ab_block=ab_block, bg_checkpoint_dir=bg_checkpoint_dir,
        mps_percentage=mps_percentage, out=out,
    )
    if model is None:
        check_model_here(loaded, plan)
    with removed_if_interrupted(out, tensorboard), _live_scalars(out, tensorboard):
        launched, path = (loaded, plan) if model is None else with_model(loaded, model, out)
        _launch(launched, path, ranks=ranks, config=config, background=bg, nodes=nodes)
    if (out / RESIZE).is_file():
        resized(launched, config, json.loads((out / RESIZE).read_text()), model)


def _live_scalars(out: Path, tensorboard: Path | None) -> contextlib.AbstractContextManager[object]:
    """``--tensorboard``: the run's steps written as TensorBoard scalars while it goes on."""
    if tensorboard is None:
        return contextlib.nullcontext()
    from deeppool.executor.training.tensorboard import LiveScalars

    return LiveScalars(out, tensorboard)


def _launch(plan: Plan, path: Path, *, ranks: int, config: RunConfig, background: BackgroundConfig | None,
            nodes: Nodes) -> None:
    from deeppool.multiplex.api import launch_with_background

    launch_with_background(plan, path, nproc=ranks, config=config, background=background,
                           worker_args=config_args(config), nodes=nodes)


@worker_app.command()
def worker(
    plan: PlanArg, steps: Steps = 50, warmup: Warmup = None, optimizer: Optim = None, lr: Lr = 0.01,
    momentum: Momentum = 0.0, backend: BackendOpt = Backend.AUTO, timeout: Timeout = DEFAULT_TIMEOUT_S,
    bucket_mb: BucketMb = 25.0, check: Check = False, check_bound: CheckBound = None,
    out: Out = Path("deeppool-run"), accumulate: Accumulate = 1, clip_norm: ClipNorm = None,
    lr_schedule: LrSchedule = ScheduleKind.CONSTANT, lr_warmup: LrWarmup = 0, checkpoint_dir: CheckpointDir = None,
    checkpoint_every: CheckpointEvery = 0, resume: Resume = False, monitor: MonitorOpt = Monitor.NONE,
    lr_scaling: LrScalingFlag = LrScaling.NONE, base_batch: BaseBatch = None, combine: CombineOpt = None,
    precision: PrecisionOpt = Precision.FP32,
    loss_scale: LossScale = LossScaling().initial, data: DataOpt = None, data_seed: DataSeed = 0,
    data_workers: DataWorkers = 0,
    policy: PolicyOpt = None, monitor_every: MonitorEvery = 10,
    batchnorm: BatchNormOpt = BatchNormMode.SYNC,
    background: BackgroundOpt = None, bg_batch: BgBatch = 8, bg_optimizer: BgOptim = OptimizerKind.SGD,
    bg_lr: BgLr = 0.01, mux: MuxOpt = MuxMode.GATE, slowdown_target: SlowdownTarget = 0.05, ab_block: AbBlock = 4,
    bg_checkpoint_dir: BgCheckpointDir = None, mps_percentage: MpsPercentage = 30, bg_broker: BgBroker = None,
) -> None:
    """Run this process's rank of PLAN (rank and world from torchrun's environment)."""
    from deeppool.executor.launch.worker import RankEnv, run_worker
    from deeppool.multiplex.hook import Multiplexer
    from deeppool.planner.plan import Plan

    env = RankEnv.from_environ()
    try:
        loaded = Plan.load(plan)  # this process's one read: the launcher's Plan stays in the launcher
        config = make_config(
            steps=steps, warmup=warmup, optimizer=optimizer or plan_optimizer(loaded), lr=lr,
            momentum=momentum, backend=backend, timeout=timeout, bucket_mb=bucket_mb, check=check,
            check_bound=check_bound, out=out, accumulate=accumulate, clip_norm=clip_norm, lr_schedule=lr_schedule,
            lr_warmup=lr_warmup, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every, resume=resume,
            monitor=monitor, lr_scaling=lr_scaling, base_batch=base_batch, combine=combine,
            precision=precision, loss_scale=loss_scale, data=data, data_seed=data_seed, data_workers=data_workers,
            policy=policy, monitor_every=monitor_every, batchnorm=batchnorm,
        )
        bg = make_background(
            background=background, bg_batch=bg_batch, bg_optimizer=bg_optimizer, bg_lr=bg_lr, mux=mux,
            slowdown_target=slowdown_target, ab_block=ab_block, bg_checkpoint_dir=bg_checkpoint_dir,
            mps_percentage=mps_percentage, out=out, bg_broker=bg_broker,
        )
        run_worker(loaded, config, env, functools.partial(Multiplexer.start, config=bg) if bg is not None else None)
    except BaseException as err:  # every failure leaves a record naming this rank
        if isinstance(err, (SystemExit, typer.Exit)):
            raise
        from deeppool.executor.launch.worker import report_failure

        kind = report_failure(err, env, out)
        raise SystemExit(kind.value) from None


def main() -> None:
    """Standalone entry (``python -m deeppool.run_command run ...``): user errors as one line, exit 2."""
    from deeppool.entry import run_app

    run_app(app)


if __name__ == "__main__":
    main()
