"""The ranks' command-line options for a :class:`RunConfig`: what ``deeppool run`` passes to every worker.

One spelling of the options, below the command line: ``deeppool run`` (:mod:`deeppool.run_command`) and
:func:`deeppool.run` (:mod:`deeppool.multiplex.api`) both use it, so the multiplexer's Python API does not
import a command line.
"""

from __future__ import annotations

from deeppool.executor.config import Adaptation, RunConfig


def config_args(config: RunConfig) -> list[str]:
    """The worker's command-line options for ``config``."""
    args = [
        "--steps", str(config.steps), "--warmup", str(config.warmup),
        "--optimizer", config.optimizer.kind.value, "--lr", repr(config.optimizer.lr),
        "--momentum", repr(config.optimizer.momentum), "--backend", config.backend.value,
        "--timeout", repr(config.timeout_s), "--bucket-mb", repr(config.bucket_mb),
        "--out", str(config.out_dir),
        "--accumulate", str(config.training.accumulate), "--lr-schedule", config.training.schedule.kind.value,
        "--lr-warmup", str(config.training.schedule.warmup_steps), "--precision", config.precision.value,
        "--loss-scale", repr(config.loss_scaling.initial), "--batchnorm", config.batchnorm.value,
    ]
    args += ["--check-bound", repr(config.check_bound)] if config.check_bound is not None else []
    if config.data is not None:
        args += ["--data", config.data.factory, "--data-seed", str(config.data.seed),
                 "--data-workers", str(config.data.workers)]
    clip, checkpoint = config.training.clip_norm, config.checkpoint
    if clip is not None:
        args += ["--clip-norm", repr(clip)]
    if checkpoint is not None:
        args += ["--checkpoint-dir", str(checkpoint.directory), "--checkpoint-every", str(checkpoint.every)]
        args += ["--resume"] if checkpoint.resume else []
    args += ["--policy", config.policy] if config.policy is not None else []
    args += ["--monitor-every", str(config.monitor_every)]
    return args + adaptation_args(config.adaptation) + (["--check"] if config.check else [])


def adaptation_args(adaptation: Adaptation) -> list[str]:
    args = ["--monitor", adaptation.monitor.value, "--lr-scaling", adaptation.lr_scaling.value]
    if adaptation.base_batch is not None:
        args += ["--base-batch", str(adaptation.base_batch)]
    return args + (["--combine", adaptation.combine.value] if adaptation.combine is not None else [])
