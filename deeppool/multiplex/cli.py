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


def _lengths(text: str) -> tuple[tuple[float, ...], bool]:
    """``--windows``: window lengths in ms, and ``whole`` for a window of one whole foreground phase."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    try:
        lengths = tuple(float(part) for part in parts if part != "whole")
    except ValueError:
        raise DeeppoolError(f"--windows '{text}': each must be a length in ms or 'whole'") from None
    if not parts or any(length <= 0 for length in lengths):
        raise DeeppoolError(f"--windows '{text}': lengths must be above 0 ms, and at least one is needed")
    return lengths, "whole" in parts


@app.command("windows")
@removes_if_interrupted("out")
def windows_command(
    *,
    background: Annotated[Path, typer.Option("--background", help="background model file")],
    out: Annotated[Path, typer.Option("--out", help="folder for interference.json")],
    windows: Annotated[str, typer.Option(help="window lengths in ms, and 'whole' (one foreground phase)")] =
        "0.5,1,2,5,20,whole",
    per_window: Annotated[int, typer.Option(help="windows lent per length")] = 20,
    mux: Annotated[str, typer.Option("--mux", help="priority (a low-priority stream lent each window) or mps (a "
                                     "client process beside the foreground)")] = "priority",
    mps_percentage: Annotated[int, typer.Option(help="--mux mps: the client's active-thread percentage")] = 30,
    plan: Annotated[Path | None, typer.Option("--plan", help="a one-rank plan: its natural windows (data loading, "
                                              "the optimizer step) lent too, into the same interference.json")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="through the fake GPU on CPU (figures not a GPU's)")] =
        False,
) -> None:
    """On one GPU: the foreground's slowdown and the background's efficiency by idle-window length."""
    import torch

    from deeppool.device.cuda import CudaGpu
    from deeppool.device.fake import FakeGpu, fake_mps_control
    from deeppool.multiplex.mps_windows import sweep_mps
    from deeppool.multiplex.natural import measure_natural
    from deeppool.multiplex.windows import Foreground, sweep, write
    from deeppool.output import console
    from deeppool.plans import Plan

    checks.existing_file(background, "--background")
    checks.out_folder(out, "--out")
    lengths, whole = _lengths(windows)
    if per_window < 1:
        raise DeeppoolError(f"--per-window {per_window} must be at least 1")
    mode = {m.value: m for m in (MuxMode.PRIORITY, MuxMode.MPS)}.get(mux)
    if mode is None:
        raise DeeppoolError(f"--mux {mux}: the window sweep runs priority or mps")
    if not 1 <= mps_percentage <= 100:
        raise DeeppoolError(f"--mps-percentage {mps_percentage} must be in [1, 100]")
    if plan is not None and mode is MuxMode.MPS:
        raise DeeppoolError("--plan with --mux mps: the natural windows are lent in priority mode only")
    one_rank = None
    if plan is not None:
        checks.existing_file(plan, "--plan")
        one_rank = Plan.load(plan)
    real = CudaGpu()
    if not dry_run and not real.available():
        raise DeeppoolError("deeppool multiplex windows needs a CUDA GPU and none is visible here (or give --dry-run)")
    gpu = FakeGpu(mps_run=fake_mps_control([], out / "mps")) if dry_run else real
    device = torch.device("cpu") if dry_run else real.bind(0)
    shape = Foreground(windows=per_window, **({"size": 128, "matmuls": 2} if dry_run else {}))
    if mode is MuxMode.MPS:
        (out / "mps").mkdir(parents=True, exist_ok=True)
        found = sweep_mps(gpu, device, background.resolve(), out / "mps", lengths, whole=whole, foreground=shape,
                          percentage=mps_percentage)
    else:
        found = sweep(gpu, device, background.resolve(), lengths, whole=whole, foreground=shape)
    natural = None if one_rank is None else \
        measure_natural(gpu, device, background.resolve(), one_rank, iterations=per_window)
    path = write(found, out, dry_run=dry_run, mode=mode, natural=None if natural is None else
                 [figures.to_json() for figures in natural])
    shown = console()
    for figures in found:
        shown.print(f"window {figures.window_ms:g} ms{' (whole)' if figures.whole else ''}: foreground "
                    f"{100 * figures.slowdown:+.1f}%, background efficiency {100 * figures.efficiency:.0f}%",
                    highlight=False)
    for kind in natural or ():
        shown.print(f"{kind.window.value} ({kind.figures.window_ms:.2f} ms): foreground "
                    f"{100 * kind.figures.slowdown:+.1f}%, background efficiency {100 * kind.figures.efficiency:.0f}%",
                    highlight=False)
    shown.print(f"wrote {path} (for `deeppool simulate --interference`, `deeppool plan --objective cluster`)",
                highlight=False)
