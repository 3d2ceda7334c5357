"""``deeppool run`` and its ranks' worker: the executor with the multiplexer wired in.

The one place above both layers where they meet: the executor runs a plan and offers its idle windows
through a :class:`~deeppool.executor.engine.idle.StartLender`; the multiplexer lends them to a background job.
``app`` holds the ``run`` command, which the main CLI mounts as ``deeppool run``; its options are the fields of
:class:`~deeppool.executor.config.RunConfig`, :class:`~deeppool.executor.config.Nodes` and
:class:`~deeppool.multiplex.config.BackgroundConfig` (:mod:`deeppool.options`). ``worker_app`` is what
``python -m deeppool.executor PLAN CONFIG`` runs on every rank: CONFIG is the one file the launcher writes
(:class:`~deeppool.executor.config.RankConfig`). A policy's request for another GPU count is re-planned here
(:func:`resized`), above the executor.
"""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from deeppool import checks, options
from deeppool.executor.config import CONFIG_FILE, Nodes, RankConfig, RunConfig, check_adaptation
from deeppool.executor.launch.cli import (
    check_model_here,
    check_ranks,
    resume_command,
    run_config,
    run_script,
    with_model,
)
from deeppool.executor.training.outputs import RESIZE
from deeppool.interrupt import removed_if_interrupted
from deeppool.multiplex.config import BACKGROUND_KEY, BackgroundConfig
from deeppool.multiplex.options import RUN_BACKGROUND, background_config
from deeppool.options import Given

if TYPE_CHECKING:
    from deeppool.executor.engine.idle import StartLender
    from deeppool.plans import Plan

RUN_SUMMARY = "Train with PLAN on --nproc local ranks (torchrun underneath) and print the timing summary."
"""``deeppool run`` in ``deeppool --help``'s list; its own help opens with an example."""

app = typer.Typer(add_completion=False, help="Run a plan on torch.distributed.")
worker_app = typer.Typer(add_completion=False, help="One rank of a plan (start it with torchrun).")
PlanArg = Annotated[Path, typer.Argument(help="plan JSON written by `deeppool plan`")]


@app.callback()
def _group() -> None:
    """Run a plan on torch.distributed."""


@app.command(short_help=RUN_SUMMARY)
@options.expand(node_options=Nodes, run_options=RunConfig, background_options=RUN_BACKGROUND)
def run(
    plan: PlanArg,
    nproc: Annotated[int | None, typer.Option(help="ranks to start here", show_default="the plan's GPU count")] = None,
    *,
    node_options: Given,
    model: Annotated[str | None, typer.Option(
        "--model", help="rebuild the model from this file or package.module:factory instead of the plan's "
        "(the plan's input shape and seed are kept)", show_default="the plan's, relative to the plan file")] = None,
    run_options: Given,
    batch: Annotated[int | None, typer.Option(
        "--batch", help="samples per optimizer step: a multiple of the plan's global batch, trained as that many "
        "micro-batches (--accumulate)", show_default="the plan's global batch x --accumulate")] = None,
    background_options: Given,
    script: Annotated[Path | None, typer.Option(
        "--script", help="run this training script on every rank instead (it calls deeppool.parallelize; "
        "$DEEPPOOL_PLAN names the plan): see docs/library.md")] = None,
    script_arg: Annotated[list[str] | None, typer.Option(
        "--script-arg", help="an argument for --script (repeat it)")] = None,
    tensorboard: Annotated[Path | None, typer.Option(
        "--tensorboard", help="write loss, throughput, GNS and background work as TensorBoard scalars here, live "
        "(every --monitor-every steps; needs the tensorboard package)")] = None,
) -> None:
    """\bExample: a 4-GPU plan on 4 local ranks, each step checked against one process:
      deeppool run plan.json --nproc 4 --steps 20 --check

    Train with PLAN on --nproc local ranks (torchrun underneath) and print the timing summary.
    """
    from deeppool.plans import Plan

    nodes = node_options.build()
    out: Path = run_options["out_dir"]
    checks.existing_file(plan, "plan file")
    checks.out_folder(out, "--out")
    checks.existing_file(background_options["model"], "--background")
    if background_options["checkpoint_dir"] is not None:
        checks.out_folder(background_options["checkpoint_dir"], "--bg-checkpoint-dir")
    loaded = Plan.load(plan)
    ranks = nproc if nproc is not None else loaded.gpus // nodes.count
    check_ranks(ranks, loaded, given=nproc is not None, nodes=nodes.count)
    if tensorboard is not None:
        from deeppool.executor.training.tensorboard import check_available

        checks.out_folder(tensorboard, "--tensorboard")
        check_available()
    if script is not None:
        run_script(loaded, plan, script, script_arg or [], ranks=ranks, out=out, timeout=run_options["timeout_s"],
                   nodes=nodes)
        return
    config = run_config(run_options, loaded, batch)
    check_adaptation(loaded, config, grouped=any(layer.gpus > 1 and layer.allreduce_ms > 0 for layer in loaded.layers))
    if config.policy is not None:
        from deeppool.adaptation.policy import load_policy

        load_policy(config.policy)  # a wrong --policy is one line here, not one per rank
    bg = background_config(background_options, out)
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

    launch_with_background(plan, path, nproc=ranks, config=config, background=background, nodes=nodes)


def resized(plan: Plan, config: RunConfig, request: dict[str, object], model: str | None) -> Path:
    """A policy asked for another GPU count: plan for it next to the checkpoint and print how to resume.

    The re-plan is the command's, above the executor (which never imports the planner's top): the run stops
    with its request in ``<out>/resize.json``, and this plans for the GPUs it asked for.
    """
    import shlex

    from deeppool.output import console
    from deeppool.planner.api import plan_model
    from deeppool.planner.hardware import KnownDevice
    from deeppool.planner.request import LOCAL, CostSource, PlanRequest, probed_source

    gpus, checkpoint = int(str(request["gpus"])), Path(str(request["checkpoint"]))
    device = plan.device if plan.device in {known.value for known in KnownDevice} else LOCAL
    planned = plan_model(plan.model, PlanRequest(gpus=gpus, global_batch=plan.global_batch, strategy=plan.strategy,
                                                 optimizer=plan.optimizer, amplification=plan.amplification_limit),
                         probed_source(CostSource(device_model=device, show_progress=False), gpus,
                                       lambda line: console().print(line, highlight=False))).plan
    path = checkpoint / f"plan-{gpus}gpus.json"
    planned.save(path)
    shown = console()
    shown.print(f"the policy asked for {gpus} GPUs after step {request['steps_done']}: checkpoint in {checkpoint}, "
                f"plan for {gpus} GPUs written to {path}; resume with:", highlight=False, markup=False)
    shown.print(shlex.join(resume_command(path, gpus, config, checkpoint, model)), highlight=False, markup=False,
                soft_wrap=True)
    return path


@worker_app.command()
def worker(
    plan: PlanArg,
    config: Annotated[Path | None, typer.Argument(
        help=f"the run's settings: the {CONFIG_FILE} that `deeppool run` writes into its --out",
        show_default="deeppool run's defaults")] = None,
) -> None:
    """Run this process's rank of PLAN (rank and world from torchrun's environment)."""
    from deeppool.executor.launch.worker import RankEnv, report_failure, run_worker
    from deeppool.plans import Plan

    env = RankEnv.from_environ()
    out = config.parent if config is not None else Given.defaults(RunConfig)["out_dir"]
    try:
        loaded = Plan.load(plan)  # this process's one read: the launcher's Plan stays in the launcher
        given = RankConfig.load(config) if config is not None else RankConfig(
            run=run_config(Given.defaults(RunConfig), loaded))
        out = given.run.out_dir
        run_worker(loaded, given.run, env, _lender(given.extra))
    except BaseException as err:  # every failure leaves a record naming this rank
        if isinstance(err, (SystemExit, typer.Exit)):
            raise
        kind = report_failure(err, env, out)
        raise SystemExit(kind.value) from None


def _lender(extra: dict[str, Any]) -> StartLender | None:
    """The rank's lender of idle windows: a background given at the start (``--background``), or the guests a
    coordinator lends the running job (:mod:`deeppool.multiplex.guests`), or none."""
    from deeppool.multiplex.guests import GUESTS_KEY, GuestLender, GuestsConfig
    from deeppool.multiplex.hook import Multiplexer

    if extra.get(BACKGROUND_KEY) is not None:
        return functools.partial(Multiplexer.start, config=BackgroundConfig.from_json(extra[BACKGROUND_KEY]))
    if extra.get(GUESTS_KEY) is not None:
        return functools.partial(GuestLender.start, config=GuestsConfig.from_json(extra[GUESTS_KEY]))
    return None


def main() -> None:
    """Standalone entry (``python -m deeppool.run_command run ...``): user errors as one line, exit 2."""
    from deeppool.entry import run_app

    run_app(app)


if __name__ == "__main__":
    main()
