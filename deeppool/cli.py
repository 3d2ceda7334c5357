"""The ``deeppool`` command line: a thin layer over the packages' Python APIs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from deeppool.errors import DeeppoolError

app = typer.Typer(
    help="Plan, run and simulate burst-parallel training (per-layer GPU counts).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

DEFAULT_CACHE = Path.home() / ".cache" / "deeppool"


def _ints(text: str | None, flag: str, example: str) -> tuple[int, ...]:
    """Comma-separated integers from the command line, or a one-line error."""
    if not text:
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise DeeppoolError(f"{flag} '{text}' is not comma-separated integers, e.g. {example}") from None


@app.command()
def plan(
    model: Annotated[str, typer.Argument(help="model file (.py with model() and inputs()) or package.module:factory")],
    gpus: Annotated[int, typer.Option(help="GPUs the foreground job gets")],
    batch: Annotated[int, typer.Option(help="global batch size (fixed: strong scaling)")] = 256,
    input_shape: Annotated[str | None, typer.Option(help="per-sample input shape for a factory, e.g. 3,224,224")] = None,
    input_dtype: Annotated[str, typer.Option(help="a factory's input dtype: float32, or int64 for token ids")] = "float32",
    vocab_size: Annotated[int, typer.Option(help="token ids are drawn below this (with an integer --input-dtype)")] = 0,
    device_model: Annotated[str | None, typer.Option(help="v100, a100, h100 (estimated) or local (measured here)")] = None,
    profile: Annotated[Path | None, typer.Option(help="plan from a profile written by `deeppool profile`")] = None,
    network: Annotated[str | None, typer.Option(help="network preset: v100, a100, h100 or local")] = None,
    network_file: Annotated[Path | None, typer.Option(help="measured network (`deeppool profile-network`)")] = None,
    gpus_per_node: Annotated[int | None, typer.Option(help="override the preset's GPUs per node")] = None,
    intra_gbps: Annotated[float | None, typer.Option(help="override the in-node bandwidth per GPU, GB/s")] = None,
    inter_gbps: Annotated[float | None, typer.Option(help="override the cross-node bandwidth per GPU, GB/s")] = None,
    amplification: Annotated[float | None, typer.Option(help="hard limit on a layer's GPU-time amplification")] = None,
    strategy: Annotated[str, typer.Option(help="which plan to write: ilp, dp (data parallel on all GPUs), best-dp (the best data-parallel width) or deeppool")] = "ilp",
    optimizer: Annotated[str, typer.Option(help="sgd or adam: optimizer state memory and step time")] = "sgd",
    precision: Annotated[str | None, typer.Option(help="fp32, tf32, bf16 or fp16 for a device model (default: the model's dtype)")] = None,
    bucket_mb: Annotated[float, typer.Option(help="the executor's gradient bucket, MiB (0: per layer, synchronous)")] = 25.0,
    objective: Annotated[str, typer.Option(help="time (iteration time under --amplification) or time+gpu-time (needs --price)")] = "time",
    price: Annotated[float, typer.Option(help="with --objective time+gpu-time: ms of iteration worth one GPU-second")] = 0.0,
    pareto: Annotated[Path | None, typer.Option(help="write a PNG of iteration time against GPU-seconds, baselines marked")] = None,
    time_limit: Annotated[float, typer.Option(help="ILP time limit, seconds")] = 60.0,
    solver: Annotated[str | None, typer.Option(help="cbc or highs (default: highs when installed)")] = None,
    no_memory_limit: Annotated[bool, typer.Option(help="do not constrain per-GPU memory")] = False,
    max_candidates: Annotated[int, typer.Option(help="thin the GPU counts per layer to about this many (0: all)")] = 32,
    local_device: Annotated[str, typer.Option(help="device to measure on with --device-model local")] = "cpu",
    max_measured_batch: Annotated[int, typer.Option(help="largest per-GPU batch measured locally (the rest is fitted)")] = 8,
    cache_dir: Annotated[Path, typer.Option(help="profile cache directory")] = DEFAULT_CACHE,
    out: Annotated[Path, typer.Option(help="where to write the plan JSON")] = Path("plan.json"),
    gantt: Annotated[Path | None, typer.Option(help="write a PNG Gantt chart of one iteration")] = None,
    per_layer: Annotated[bool, typer.Option(help="print every layer, not stages")] = False,
) -> None:
    """Trace MODEL, profile it (or estimate for a GPU model) and solve its burst-parallel plan."""
    from deeppool.planner import report
    from deeppool.planner.api import LOCAL, CostSource, PlanRequest, plan_model
    from deeppool.planner.cost import Optimizer
    from deeppool.planner.hardware import Precision
    from deeppool.planner.ilp import SolverName
    from deeppool.planner.modelspec import ModelSpec
    from deeppool.planner.plan import Strategy
    from deeppool.planner.strategies import Objective

    request = PlanRequest(
        gpus=gpus,
        global_batch=batch,
        strategy=_enum(Strategy, strategy, "--strategy"),
        optimizer=_enum(Optimizer, optimizer, "--optimizer"),
        amplification=amplification,
        enforce_memory=not no_memory_limit,
        time_limit_s=time_limit,
        solver=_enum(SolverName, solver, "--solver") if solver else None,
        max_candidates=max_candidates or None,
        bucket_mb=bucket_mb,
        precision=Precision.parse(precision) if precision else None,
        objective=_enum(Objective, objective, "--objective"),
        price=price,
    )
    source = CostSource(
        device_model=(device_model or LOCAL).lower(),
        profile_path=profile,
        local_device=local_device,
        max_measured_batch=max_measured_batch,
        cache_dir=cache_dir,
        network=network.lower() if network else None,
        network_file=network_file,
        gpus_per_node=gpus_per_node,
        intra_gbps=intra_gbps,
        inter_gbps=inter_gbps,
    )
    if profile is not None and device_model is not None:
        raise DeeppoolError("give either --profile or --device-model, not both")
    spec = ModelSpec.parse(
        model, input_shape=_ints(input_shape, "--input-shape", "3,224,224"), input_dtype=input_dtype,
        vocab_size=vocab_size,
    )
    planned = plan_model(spec, request, source)
    planned.plan.save(out)
    console = Console()
    if planned.cost.profile.fit is not None:
        console.print(planned.cost.profile.fit.describe())
    console.print(report.plan_table(planned.plan, per_layer=per_layer))
    console.print(report.summary(planned.plan))
    console.print(f"plan written to {out}")
    if gantt is not None:
        report.gantt(planned.plan, planned.cost, gantt)
        console.print(f"Gantt chart written to {gantt}")
    if pareto is not None:
        from deeppool.planner.pareto import front, plot

        plot(front(planned), pareto)
        console.print(f"Pareto front written to {pareto}")


@app.command("profile")
def profile_command(
    model: Annotated[str, typer.Argument(help="model file or package.module:factory")],
    out: Annotated[Path, typer.Option(help="where to write the profile JSON")],
    device: Annotated[str, typer.Option(help="cpu or cuda[:N]")] = "cpu",
    batches: Annotated[str, typer.Option(help="per-GPU batch sizes to measure")] = "1,2,4,8,16,32",
    input_shape: Annotated[str | None, typer.Option(help="per-sample input shape for a factory")] = None,
    input_dtype: Annotated[str, typer.Option(help="a factory's input dtype: float32, or int64 for token ids")] = "float32",
    vocab_size: Annotated[int, typer.Option(help="token ids are drawn below this (with an integer --input-dtype)")] = 0,
    warmup: Annotated[int, typer.Option(help="untimed runs per layer and batch")] = 2,
    repeats: Annotated[int, typer.Option(help="timed runs (median taken)")] = 5,
    cache_dir: Annotated[Path, typer.Option(help="profile cache directory")] = DEFAULT_CACHE,
) -> None:
    """Measure every layer's forward and backward time on DEVICE and write a profile."""
    from deeppool.planner.modelspec import ModelSpec
    from deeppool.planner.profiler import ProfilerConfig, measure_profile
    from deeppool.planner.trace import trace

    config = ProfilerConfig(
        device=device, batches=_ints(batches, "--batches", "1,2,4,8"), warmup=warmup, repeats=repeats, cache_dir=cache_dir
    )
    loaded = ModelSpec.parse(
        model, input_shape=_ints(input_shape, "--input-shape", "3,224,224"), input_dtype=input_dtype,
        vocab_size=vocab_size,
    ).load()
    measured = measure_profile(trace(loaded), loaded, config)
    measured.save(out)
    if measured.fit is not None:
        Console().print(measured.fit.describe())
    Console().print(f"profiled {len(measured.layers)} layers on {measured.device} at batches {config.batches}: {out}")


def _enum(kind, value: str, flag: str):
    try:
        return kind(value.lower())
    except ValueError:
        choices = ", ".join(member.value for member in kind)
        raise DeeppoolError(f"{flag} '{value}' is not one of {choices}") from None


def _mount_package_commands() -> None:
    """The executor's, the multiplexer's and the simulator's commands, each defined in its own package."""
    from deeppool.cluster_sim.cli import simulate
    from deeppool.executor.cli import profile_network, run
    from deeppool.multiplex.cli import app as multiplex_app

    app.command("run")(run)
    app.add_typer(multiplex_app, name="multiplex")
    app.command("profile-network")(profile_network)
    app.command("simulate")(simulate)


def main() -> None:
    """Entry point: user mistakes print one line and exit 2, never a traceback."""
    _mount_package_commands()
    try:
        app()
    except DeeppoolError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)


if __name__ == "__main__":
    main()
