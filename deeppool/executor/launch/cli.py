"""The executor's command-line pieces: the run's checks, its config from the options, and two commands.

``deeppool run``'s options are :class:`~deeppool.executor.config.RunConfig`'s fields (:mod:`deeppool.options`);
:func:`run_config` builds the config from them for ``deeppool run`` (:mod:`deeppool.run_command`, which wires
the multiplexer in); :func:`profile_network` is ``deeppool profile-network`` and :func:`export` is
``deeppool export``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from deeppool import checks, options
from deeppool.errors import DeeppoolError
from deeppool.executor.config import CheckpointConfig, DataConfig, Nodes, RunConfig
from deeppool.interrupt import removed_if_interrupted
from deeppool.model.loading import load_model
from deeppool.options import Given
from deeppool.plans import Optimizer
from deeppool.planner.profiling.netprobe_config import DEFAULT_SIZES, ProbeConfig

if TYPE_CHECKING:
    from deeppool.plans import Plan

DEFAULT_WARMUP = 5


def run_config(given: Given, plan: Plan, batch: int | None = None) -> RunConfig:
    """The run's config from ``deeppool run``'s options (:class:`RunConfig`'s fields), with what its command
    line leaves to the plan: the optimizer the plan was made for, ``--warmup``'s default (5, or one less than
    ``--steps`` when that is fewer), the micro-batches of ``--batch`` samples per step."""
    steps, warmup = given["steps"], given["warmup"]
    if warmup is not None and steps >= 1 and warmup >= steps:
        raise DeeppoolError(
            f"--warmup {warmup} must be less than --steps {steps}: the warm-up iterations are not timed, "
            f"so at least one must remain (e.g. --warmup {max(steps - 1, 0)})"
        )
    data = given["data.factory"]
    return given.build({
        "warmup": min(DEFAULT_WARMUP, max(steps - 1, 0)) if warmup is None else warmup,
        "optimizer.kind": given["optimizer.kind"] or plan_optimizer(plan),
        "training.accumulate": micro_batches(plan, batch, given["training.accumulate"]),
        "training.schedule.total_steps": max(steps, 1),
        "data.factory": _located(DataConfig(factory=data).factory) if data is not None else None,
    })


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
    launch(plan, plan_path, nproc=ranks, config=RunConfig(out_dir=out, timeout_s=timeout), script_args=args,
           nodes=nodes, script=script)


def resume_command(plan_path: Path, gpus: int, config: RunConfig, checkpoint: Path, model: str | None) -> list[str]:
    """``deeppool run`` continuing ``config``'s run from ``checkpoint`` under the plan for ``gpus`` GPUs."""
    import dataclasses

    every = config.checkpoint.every if config.checkpoint is not None else 0
    resumed = dataclasses.replace(config, checkpoint=CheckpointConfig(directory=checkpoint, every=every, resume=True))
    command = ["deeppool", "run", str(plan_path), "--nproc", str(gpus), *options.argv(RunConfig, resumed)]
    return command + (["--model", model] if model is not None else [])


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
    from deeppool.plans import ModelSource

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
    per_core = checks.CPU_RANKS_PER_CORE
    return per_core * cores, f"{cores} CPU core(s), at most {per_core} gloo ranks per core"


def with_model(plan: Plan, model: str, out: Path) -> tuple[Plan, Path]:
    """A copy of ``plan`` whose model is rebuilt from ``model`` (the plan's inputs and seed kept), and the file in
    ``out`` it is saved to."""
    import dataclasses

    from deeppool.plans import ModelSpec

    if model.endswith(".py") or Path(model).exists():
        spec = ModelSpec.parse(model, seed=plan.model.seed)  # a model file makes its own inputs
    else:
        spec = ModelSpec.parse(model, input_shape=plan.model.input_shape, input_dtype=plan.model.input_dtype,
                               vocab_size=plan.model.vocab_size, seed=plan.model.seed)
    out.mkdir(parents=True, exist_ok=True)
    path, copy = out / "plan.json", dataclasses.replace(plan, model=spec)
    copy.save(path)
    return copy, path


def plan_optimizer(plan: Plan) -> Optimizer:
    """The optimizer the plan was made for (its memory and step time assume it)."""
    return Optimizer(plan.optimizer.value)


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
    if nproc > checks.CPU_RANKS_PER_CORE * cores:
        raise DeeppoolError(f"--nproc {nproc} is more than {checks.CPU_RANKS_PER_CORE} processes per CPU core "
                            f"({cores} here): the probe would measure contention, not the network")
    with removed_if_interrupted(out):
        _probe(config, out)


def _probe(config: ProbeConfig, out: Path) -> None:
    from deeppool.executor.launch.report import fit_table
    from deeppool.output import console
    from deeppool.planner.profiling.netprobe import probe_network

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
    from deeppool.plans import Plan

    model = load_model(Plan.load(path).model).module
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        name, what = (missing[0], "has no") if missing else (unexpected[0], "has an unknown")
        raise DeeppoolError(f"the checkpoint {what} tensor '{name}' for the model of plan '{path}': "
                            "export the checkpoint of a run of that plan")
