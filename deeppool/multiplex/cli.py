"""``deeppool multiplex``: the multiplexing commands (``bench``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from deeppool import checks, options
from deeppool.errors import DeeppoolError
from deeppool.executor.config import RunConfig
from deeppool.interrupt import removes_if_interrupted
from deeppool.multiplex.config import BackgroundConfig, MuxMode
from deeppool.multiplex.options import BENCH_BACKGROUND
from deeppool.options import Given

BENCH_WARMUP = 3
"""Foreground iterations of each mode left out of the timing."""

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Background jobs on a plan's idle windows.")


def _modes(text: str) -> tuple[MuxMode, ...]:
    try:
        chosen = tuple(MuxMode(part.strip()) for part in text.split(","))
    except ValueError:
        names = ", ".join(m.value for m in MuxMode)
        raise DeeppoolError(f"--modes '{text}': each must be one of {names}") from None
    if len(set(chosen)) != len(chosen):
        raise DeeppoolError(f"--modes '{text}' names a mode twice")
    return chosen


@app.command("bench")
@removes_if_interrupted("out")
@options.expand(background=BENCH_BACKGROUND)
def bench_command(
    plan: Annotated[Path, typer.Argument(help="plan JSON written by `deeppool plan`")],
    *,
    background: Given,
    out: Annotated[Path, typer.Option("--out", help="folder for multiplex.json, interference.json and the runs")],
    modes: Annotated[str, typer.Option(help="comma-separated modes (CPU: none,sched_idle,gate)")] = "none,sched_idle,gate",
    steps: Annotated[int, typer.Option(help="foreground iterations per mode")] = 60,
) -> None:
    """Run PLAN with the background in each mode and compare the foreground alone vs shared."""
    from deeppool.plans import Plan

    model = background["model"]
    checks.existing_file(plan, "plan file")
    checks.existing_file(model, "--background")
    checks.out_folder(out, "--out")
    chosen = _modes(modes)
    checks.positive(background["optimizer.lr"], "--bg-lr")
    if steps <= BENCH_WARMUP:
        raise DeeppoolError(f"--steps {steps} must be more than the {BENCH_WARMUP} warm-up iterations of each mode")
    config = background.build({"model": model.resolve()})
    run_config = RunConfig(steps=steps, warmup=BENCH_WARMUP, out_dir=out)
    Plan.load(plan)  # a corrupted or old plan is refused before any run starts
    _bench(plan, config, chosen, run_config, background=model)


def _bench(plan: Path, config: BackgroundConfig, modes: tuple[MuxMode, ...], run_config: RunConfig, *,
           background: Path) -> None:
    from deeppool.multiplex.bench import bench, write_interference
    from deeppool.multiplex.report import mode_table
    from deeppool.output import console

    out = run_config.out_dir
    reports = bench(plan, config, modes, config=run_config, out=out)
    shown = console()
    shown.print(mode_table(reports, title=f"multiplex bench: {plan.name}, background {background.name}"))
    shown.print(f"wrote {out}/multiplex.json", highlight=False)
    write_interference(reports, config.slowdown_target, out)  # a one-line error when no gated mode qualifies
    shown.print(f"wrote {out}/interference.json (for `deeppool simulate --interference`)", highlight=False)
