"""The background options of ``deeppool run`` (and its workers), and their typed config."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from deeppool import checks
from deeppool.executor.config import OptimizerConfig, OptimizerKind
from deeppool.multiplex.config import ABSchedule, BackgroundConfig, MuxMode

BackgroundOpt = Annotated[Path | None, typer.Option(
    "--background", help="background model file: trains in the plan's idle windows")]
BgBatch = Annotated[int, typer.Option(help="background batch size")]
BgOptim = Annotated[OptimizerKind, typer.Option("--bg-optimizer", help="background optimizer")]
BgLr = Annotated[float, typer.Option(help="background learning rate")]
MuxOpt = Annotated[MuxMode, typer.Option("--mux", help="how background work keeps out of the foreground's way")]
SlowdownTarget = Annotated[float, typer.Option(help="foreground slowdown the controller aims under (fraction)")]
AbBlock = Annotated[int, typer.Option(help="A/B: steps per alone or shared block")]
BgCheckpointDir = Annotated[Path | None, typer.Option(
    help="where the background job checkpoints and resumes (default: OUT/background)")]
MpsPercentage = Annotated[int, typer.Option(help="--mux mps: the background client's active-thread percentage")]
BgBroker = Annotated[Path | None, typer.Option(hidden=True, help="a coordinator's guest of another account: "
                                                             "the broker that starts its processes")]


def make_background(
    *, background: Path | None, bg_batch: int, bg_optimizer: OptimizerKind, bg_lr: float, mux: MuxMode,
    slowdown_target: float, ab_block: int, bg_checkpoint_dir: Path | None, mps_percentage: int, out: Path,
    bg_broker: Path | None = None,
) -> BackgroundConfig | None:
    if background is None:
        return None
    checks.positive(bg_lr, "--bg-lr")
    return BackgroundConfig(
        model=background.resolve(), batch=bg_batch, optimizer=OptimizerConfig(kind=bg_optimizer, lr=bg_lr),
        mode=mux, slowdown_target=slowdown_target, schedule=ABSchedule(block=ab_block),
        checkpoint_dir=(bg_checkpoint_dir or out / "background").resolve(), mps_percentage=mps_percentage,
        broker=bg_broker,
    )


def background_args(config: BackgroundConfig | None) -> list[str]:
    """The workers' options for ``config``."""
    if config is None:
        return []
    return [
        "--background", str(config.model), "--bg-batch", str(config.batch),
        "--bg-optimizer", config.optimizer.kind.value, "--bg-lr", repr(config.optimizer.lr),
        "--mux", config.mode.value, "--slowdown-target", repr(config.slowdown_target),
        "--ab-block", str(config.schedule.block), "--bg-checkpoint-dir", str(config.checkpoint_dir),
        "--mps-percentage", str(config.mps_percentage),
        *(["--bg-broker", str(config.broker)] if config.broker is not None else []),
    ]
