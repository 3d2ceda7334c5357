"""The ``deeppool`` command line: a thin layer over the packages' Python APIs."""

from __future__ import annotations

import enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from deeppool.errors import DeeppoolError
from deeppool.interrupt import removed_if_interrupted
from deeppool.model.loading import load_model
from deeppool.plans import Combine
from deeppool.planner.solve.throughput import DEFAULT_CLUSTER_GAP

if TYPE_CHECKING:  # each command imports its work (and torch) only after its options are checked
    from deeppool.plans import ModelSpec
    from deeppool.planner.api import Planned
    from deeppool.planner.batch_search import BatchSearchRequest
    from deeppool.planner.request import CostSource, PlanRequest
    from deeppool.planner.solve.ilp import SolverName

app = typer.Typer(
    help="Plan, run and simulate burst-parallel training (per-layer GPU counts).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

EnumT = TypeVar("EnumT", bound=enum.Enum)
DEFAULT_CACHE = Path.home() / ".cache" / "deeppool"
LOCAL = "local"
PLAN_SUMMARY = "Trace MODEL, profile it (or estimate for a GPU model) and solve its burst-parallel plan."
"""``deeppool plan`` in ``deeppool --help``'s list; its own help opens with an example (``\\b`` keeps its lines)."""
NOISY_SHARE = 0.25
"""A locally measured plan is flagged when more than this share of its measurements stayed noisy."""


@app.callback()
def _options(verbose: Annotated[bool, typer.Option(
        "--verbose", help="show solver banners and library warnings (or set DEEPPOOL_VERBOSE=1)")] = False) -> None:
    """Plan, run and simulate burst-parallel training (per-layer GPU counts)."""
    from deeppool.quiet import configure

    configure(verbose)


@app.command(short_help=PLAN_SUMMARY)
def plan(
    model: Annotated[str, typer.Argument(help="model file (.py with model() and inputs()) or package.module:factory")],
    gpus: Annotated[int, typer.Option(help="GPUs the foreground job gets (at most --batch: one sample each)")],
    batch: Annotated[str, typer.Option(
        help="global batch size (fixed: strong scaling), or auto: the batch with the best goodput (needs --gns)")] = "256",
    gns: Annotated[float | None, typer.Option(help="with --batch auto: the gradient noise scale φ, in samples")] = None,
    base_batch: Annotated[int | None, typer.Option(
        help="with --batch auto: the base batch B₀ of E(B) = (φ + B₀)/(φ + B)", show_default="the smallest candidate")] = None,
    batches: Annotated[str | None, typer.Option(
        help="with --batch auto: candidate global batches, e.g. 64,128,256",
        show_default="powers of two from the base batch or --gpus, 8 at most")] = None,
    goodput_plot: Annotated[Path | None, typer.Option(
        help="with --batch auto: PNG of goodput and throughput against the batch",
        show_default="MODEL-goodput.png")] = None,
    input_shape: Annotated[str | None, typer.Option(help="a factory's per-sample input shape, e.g. 3,224,224")] = None,
    input_dtype: Annotated[str, typer.Option(help="a factory's input dtype: float32, or int64 for token ids")] = "float32",
    vocab_size: Annotated[int, typer.Option(help="token ids are drawn below this (with an integer --input-dtype)")] = 0,
    device_model: Annotated[str | None, typer.Option(
        help="v100, a100, h100, h200 (estimated) or local (measured here)", show_default="local")] = None,
    profile: Annotated[Path | None, typer.Option(help="plan from a profile written by `deeppool profile`")] = None,
    network: Annotated[str | None, typer.Option(
        help="network preset: v100, a100, h100, h200 or local", show_default="the device model's")] = None,
    network_file: Annotated[Path | None, typer.Option(help="measured network (`deeppool profile-network`)")] = None,
    gpus_per_node: Annotated[int | None, typer.Option(help="override the preset's GPUs per node")] = None,
    intra_gbps: Annotated[float | None, typer.Option(help="override the in-node bandwidth per GPU, GB/s")] = None,
    inter_gbps: Annotated[float | None, typer.Option(help="override the cross-node bandwidth per GPU, GB/s")] = None,
    amplification: Annotated[float | None, typer.Option(
        help="hard limit on a layer's GPU-time amplification: its time x GPUs over its time on one GPU (>= 1)",
        show_default="no limit")] = None,
    strategy: Annotated[str, typer.Option(
        help="which plan to write: ilp, dp (data parallel on all GPUs), best-dp (data parallel at its best width) "
             "or deeppool (the paper's planner)")] = "ilp",
    optimizer: Annotated[str, typer.Option(help="sgd, adam or kfac (SGD with K-FAC, its factors priced per layer): optimizer state memory and step time")] = "sgd",
    precision: Annotated[str | None, typer.Option(help="fp32, tf32, bf16 or fp16 for a device model (default: the model's dtype)")] = None,
    bucket_mb: Annotated[float, typer.Option(help="the executor's gradient bucket, MiB (0: per layer, synchronous)")] = 25.0,
    objective: Annotated[str, typer.Option(
        help="time (iteration time under --amplification), time+gpu-time (needs --price) or cluster (the cluster's "
             "throughput: the foreground's share plus background work in the plan's idle windows)")] = "time",
    interference: Annotated[Path | None, typer.Option(
        help="interference.json (`deeppool multiplex bench`): background efficiency by window length and the "
             "foreground's slowdown, for the cluster throughput", show_default="the simulator's defaults")] = None,
    price: Annotated[float, typer.Option(help="with --objective time+gpu-time: ms of iteration worth one GPU-second")] = 0.0,
    cluster_gap: Annotated[float, typer.Option(
        help="with --objective cluster: stop once no plan can beat the chosen one by more than this share "
             "(0: the proven best; like a MIP gap)")] = DEFAULT_CLUSTER_GAP,
    pareto: Annotated[Path | None, typer.Option(help="write a PNG of iteration time against GPU-seconds, baselines marked")] = None,
    pin: Annotated[list[str] | None, typer.Option(
        help="GLOB=N: the layers whose names match GLOB (fnmatch, e.g. 'layer4.*') run on N GPUs; the ILP solves "
             "the rest (repeat; recorded in the plan)")] = None,
    time_limit: Annotated[float, typer.Option(help="ILP time limit, seconds")] = 60.0,
    solver: Annotated[str | None, typer.Option(help="cbc or highs", show_default="highs when installed")] = None,
    no_memory_limit: Annotated[bool, typer.Option(
        "--no-memory-limit", help="do not constrain per-GPU memory (default: plans fit the device's memory)")] = False,
    max_candidates: Annotated[int, typer.Option(help="thin the GPU counts per layer to about this many (0: all)")] = 32,
    local_device: Annotated[str, typer.Option(help="cpu or cuda[:N]: where --device-model local measures")] = "cpu",
    max_measured_batch: Annotated[int | None, typer.Option(
        help="cap on the per-GPU batches measured locally (above it, fitted; the plan names the layers that rest "
             "on them)", show_default="none: every per-GPU batch the plan and its baselines use is measured")] = None,
    cache_dir: Annotated[Path, typer.Option(help="profile cache directory")] = DEFAULT_CACHE,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="measure everything afresh: neither read nor write "
                                           "the profile cache")] = False,
    out: Annotated[Path | None, typer.Option(
        help="where to write the plan JSON", show_default="MODEL-plan.json, e.g. resnet50-plan.json")] = None,
    gantt: Annotated[Path | None, typer.Option(help="write a Gantt chart of one iteration (.png, .pdf, .svg)")] = None,
    per_layer: Annotated[bool, typer.Option(help="print every layer, not stages")] = False,
    combine: Annotated[str, typer.Option(
        help="how each layer group combines gradients when run: sum (the mean gradient) or adasum "
             "(any group size; recorded in the plan)")] = "sum",
) -> None:
    """\bExample: VGG-16 on 64 A100s, from the A100 device model (no GPU needed):
      deeppool plan examples/vgg16.py --gpus 64 --batch 128 --device-model a100

    Trace MODEL, profile it (or estimate for a GPU model) and solve its burst-parallel plan.
    """
    import dataclasses

    from deeppool import checks
    from deeppool.plans import ModelSpec, Optimizer, Pin, Precision, Strategy
    from deeppool.planner.request import CostSource, Objective, PlanRequest, check_precision, check_samples

    out = out or default_output(model, "plan.json")
    choice = _enum(Combine, combine, "--combine")
    search = _batch_search(batch, gpus, gns=gns, base_batch=base_batch, batches=batches, plot=goodput_plot)
    if search is not None:
        goodput_plot = goodput_plot or default_output(model, "goodput.png")
    checks.new_file(out, "--out")
    checks.new_file(gantt, "--gantt", checks.IMAGE_SUFFIXES)
    checks.new_file(pareto, "--pareto", checks.IMAGE_SUFFIXES)
    checks.new_file(goodput_plot, "--goodput-plot", (".png",))
    checks.existing_file(interference, "--interference")
    checks.distinct({"--out": out, "--gantt": gantt, "--pareto": pareto, "--goodput-plot": goodput_plot,
                     "MODEL": Path(model) if model.endswith(".py") else None, "--profile": profile})
    if profile is not None and device_model is not None:
        raise DeeppoolError("give either --profile or --device-model, not both")
    global_batch = search.candidates()[0] if search is not None else int(batch)
    request = PlanRequest(
        gpus=gpus,
        global_batch=global_batch,
        strategy=_enum(Strategy, strategy, "--strategy"),
        optimizer=_enum(Optimizer, optimizer, "--optimizer"),
        amplification=amplification,
        enforce_memory=not no_memory_limit,
        time_limit_s=time_limit,
        solver=_solver(solver) if solver else None,
        max_candidates=max_candidates or None,
        bucket_mb=bucket_mb,
        precision=Precision.parse(precision) if precision else None,
        objective=_enum(Objective, objective, "--objective"),
        price=price,
        cluster_gap=cluster_gap,
        pins=tuple(Pin.parse(text) for text in pin or ()),
        **_interference(interference),
    )
    check_samples(gpus, global_batch)
    source = CostSource(
        device_model=(device_model or LOCAL).lower(),
        profile_path=profile,
        local_device=local_device,
        max_measured_batch=max_measured_batch,
        cache_dir=None if no_cache else cache_dir,
        network=network.lower() if network else None,
        network_file=network_file,
        gpus_per_node=gpus_per_node,
        intra_gbps=intra_gbps,
        inter_gbps=inter_gbps,
    )
    check_precision(request, source)
    if source.measures_locally and not no_cache:
        checks.out_folder(cache_dir, "--cache-dir")
    spec = ModelSpec.parse(
        model, input_shape=checks.positive_ints(input_shape, "--input-shape", "3,224,224"), input_dtype=input_dtype,
        vocab_size=vocab_size,
    )
    from deeppool.output import console
    from deeppool.planner.request import probed_source

    source = probed_source(source, gpus, lambda line: console().print(line, highlight=False))
    with removed_if_interrupted(out, gantt, pareto, goodput_plot):
        if search is not None:
            assert goodput_plot is not None
            planned = _search_and_report(spec, request, source, search, goodput_plot)
        else:
            from deeppool.planner.api import plan_model

            planned = plan_model(spec, request, source)
        planned = dataclasses.replace(planned, plan=dataclasses.replace(planned.plan, combine=choice))
        _report_plan(planned, out=out, gantt=gantt, pareto=pareto, per_layer=per_layer)


def _batch_search(batch: str, gpus: int, *, gns: float | None, base_batch: int | None, batches: str | None,
                  plot: Path | None) -> BatchSearchRequest | None:
    """``--batch auto`` and its options as a search request; a fixed ``--batch`` refuses them."""
    from deeppool import checks
    from deeppool.planner.batch_search import BatchSearchRequest

    auto_only = {"--gns": gns, "--base-batch": base_batch, "--batches": batches, "--goodput-plot": plot}
    if batch.strip().lower() != "auto":
        given = [flag for flag, value in auto_only.items() if value is not None]
        if given:
            raise DeeppoolError(f"{given[0]} needs --batch auto (the batch search); drop it or pass --batch auto")
        try:
            int(batch)
        except ValueError:
            raise DeeppoolError(f"--batch '{batch}' is neither a number nor auto: give e.g. --batch 256") from None
        return None
    if gns is None:
        raise DeeppoolError("--batch auto needs --gns: give the gradient noise scale in samples, e.g. --gns 2000")
    candidates = checks.positive_ints(batches, "--batches", "64,128,256") if batches is not None else ()
    if batches is not None and not candidates:
        raise DeeppoolError("--batches is empty: give global batch sizes, e.g. 64,128,256")
    return BatchSearchRequest(gpus=max(gpus, 1), noise_scale=gns, base_batch=base_batch, batches=candidates)


def _search_and_report(spec: ModelSpec, request: PlanRequest, source: CostSource, search: BatchSearchRequest,
                       plot_path: Path) -> Planned:
    """Plan every candidate batch with a progress bar; print the goodput table; plot it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from deeppool.output import console
    from deeppool.planner import batch_search
    from deeppool.planner.api import batch_planner

    shown = console()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=shown, transient=True) as progress:
        task = progress.add_task("planning candidate batches", total=len(search.candidates()))
        solve = batch_planner(spec, request, source)
        planned, result = batch_search.search_batches(
            solve, search, on_solved=lambda b: progress.update(task, advance=1, description=f"planned batch {b}"),
            on_stopped=lambda b, why: shown.print(f"batch {b} and above not planned: {why}", style="yellow"))
    shown.print(batch_search.table(result))
    batch_search.plot(result, plot_path)
    chosen = result.chosen
    shown.print(f"best goodput at global batch {chosen.batch} ({chosen.goodput:,.0f} base-batch samples/s, "
                f"E = {chosen.efficiency:.3f}, {chosen.gpus} GPUs used); goodput plot written to {plot_path}")
    return planned


def _report_plan(planned: Planned, *, out: Path, gantt: Path | None, pareto: Path | None, per_layer: bool) -> None:
    from deeppool.output import console
    from deeppool.planner import report

    planned.plan.save(out)
    shown = console()
    if planned.cost.profile.fit is not None:
        shown.print(planned.cost.profile.fit.describe())
    shown.print(report.plan_table(planned.plan, per_layer=per_layer))
    shown.print(report.summary(planned.plan))
    shown.print(report.cluster_line(planned.plan))
    for line in report.evidence_lines(planned.plan):
        shown.print(line, style="yellow", highlight=False)
    for line in report.tracing_lines(planned.plan):
        shown.print(line, highlight=False, markup=False)
    fit = planned.cost.profile.fit
    if fit is not None and fit.noisy > NOISY_SHARE * fit.measurements:
        shown.print(f"warning: do not trust this plan: {fit.noisy} of {fit.measurements} measurements stayed noisy "
                    f"(spread above {100 * fit.spread_bound:.0f}% over repeats: a busy machine, or layers too short "
                    "to time), so its times are not this model's; re-plan on a quieter machine (the "
                    "cache measures them again then), with --no-cache, or with --device-model", style="bold red",
                    highlight=False)
    shown.print(report.AMPLIFICATION_NOTE, style="dim")
    shown.print(f"plan written to {out}")
    if gantt is not None:
        report.gantt(planned.plan, planned.cost, gantt)
        shown.print(f"Gantt chart written to {gantt}")
    if pareto is not None:
        from deeppool.planner.pareto import front, plot

        plot(front(planned), pareto)
        shown.print(f"Pareto front written to {pareto}")


def default_output(model: str, suffix: str) -> Path:
    """``resnet50-plan.json`` for ``examples/resnet50.py``, ``small_cnn-plan.json`` for ``pkg.mod:small_cnn``."""
    name = model.rpartition(":")[2] if ":" in model and not model.endswith(".py") else Path(model).stem
    return Path(f"{name or 'model'}-{suffix}")


@app.command("profile")
def profile_command(
    model: Annotated[str | None, typer.Argument(
        help="model file or package.module:factory (optional with --clear-cache)")] = None,
    out: Annotated[Path | None, typer.Option(help="where to write the profile JSON (needed with MODEL)")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda[:N]")] = "cpu",
    batches: Annotated[str, typer.Option(help="per-GPU batch sizes to measure")] = "1,2,4,8,16,32",
    input_shape: Annotated[str | None, typer.Option(help="a factory's per-sample input shape, e.g. 3,224,224")] = None,
    input_dtype: Annotated[str, typer.Option(help="a factory's input dtype: float32, or int64 for token ids")] = "float32",
    vocab_size: Annotated[int, typer.Option(help="token ids are drawn below this (with an integer --input-dtype)")] = 0,
    warmup: Annotated[int, typer.Option(help="untimed runs per layer and batch")] = 2,
    repeats: Annotated[int, typer.Option(help="timed runs (median taken)")] = 5,
    cache_dir: Annotated[Path, typer.Option(help="profile cache directory")] = DEFAULT_CACHE,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="measure everything afresh: neither read nor write "
                                           "the profile cache")] = False,
    clear_cache: Annotated[bool, typer.Option("--clear-cache", help="remove the layer-time cache in --cache-dir "
                                              "(then profile MODEL, if given)")] = False,
) -> None:
    """Measure every layer's forward and backward time on DEVICE and write a profile."""
    from deeppool import checks
    from deeppool.plans import ModelSpec

    if model is None and not clear_cache:
        raise DeeppoolError("give a MODEL to profile (or --clear-cache to empty the cache)")
    if model is not None and out is None:
        raise DeeppoolError("--out is needed: where to write the profile JSON, e.g. --out profile.json")
    if clear_cache and no_cache:
        raise DeeppoolError("give either --clear-cache or --no-cache, not both")
    if not no_cache:
        checks.out_folder(cache_dir, "--cache-dir")
    if model is None:
        _clear(cache_dir)
        return
    assert out is not None
    checks.new_file(out, "--out")
    checks.distinct({"--out": out, "MODEL": Path(model) if model.endswith(".py") else None})
    checks.device(device, "--device")
    measured_batches = checks.positive_ints(batches, "--batches", "1,2,4,8")
    if not measured_batches:
        raise DeeppoolError("--batches is empty: give per-GPU batch sizes, e.g. 1,2,4,8")
    checks.at_least(warmup, 0, "--warmup")
    checks.at_least(repeats, 1, "--repeats")
    spec = ModelSpec.parse(
        model, input_shape=checks.positive_ints(input_shape, "--input-shape", "3,224,224"), input_dtype=input_dtype,
        vocab_size=vocab_size,
    )
    if clear_cache:
        _clear(cache_dir)
    with removed_if_interrupted(out):
        _measure(spec, out=out, device=device, batches=measured_batches, warmup=warmup, repeats=repeats,
                 cache_dir=None if no_cache else cache_dir)


def _clear(cache_dir: Path) -> None:
    from deeppool.output import console
    from deeppool.planner.profiling.cache import CACHE_FILE, clear_cache

    removed = clear_cache(cache_dir)
    console().print(f"removed {removed} cached layer times ({cache_dir / CACHE_FILE})" if removed
                    else f"no layer-time cache in {cache_dir}", highlight=False)


def _measure(spec: ModelSpec, *, out: Path, device: str, batches: tuple[int, ...], warmup: int, repeats: int,
             cache_dir: Path | None) -> None:
    from deeppool.model.trace import trace
    from deeppool.output import console
    from deeppool.planner.profiling.profiler import ProfilerConfig, measure_profile

    config = ProfilerConfig(device=device, batches=batches, warmup=warmup, repeats=repeats, cache_dir=cache_dir)
    loaded = load_model(spec)
    measured = measure_profile(trace(loaded), loaded, config)
    measured.save(out)
    if measured.fit is not None:
        console().print(measured.fit.describe())
    busy = sorted(name for name, times in measured.layers.items() if any(times.busy))
    if busy:
        conditions = measured.conditions
        load = f" (load up to {conditions.load:.1f} on {conditions.cores} cores)" if conditions else ""
        console().print(f"warning: {len(busy)} of {len(measured.layers)} layers rest on measurements taken on a "
                        f"busy machine{load}, while the host's speed moved, or that stayed noisy: {_names(busy)}",
                        style="yellow", highlight=False)
    console().print(f"profiled {len(measured.layers)} layers on {measured.device} at batches {config.batches}: {out}")


def _names(names: list[str], shown: int = 6) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def _interference(path: Path | None) -> dict[str, object]:
    """``--interference`` as the request's model and its source (the simulator's defaults without it)."""
    if path is None:
        return {}
    from deeppool.planner.profiling.interference import InterferenceModel

    return {"interference": InterferenceModel.measured(path), "interference_source": str(path)}


def _solver(name: str) -> SolverName:
    from deeppool.planner.solve.ilp import SolverName

    return _enum(SolverName, name, "--solver")


def _enum(kind: type[EnumT], value: str, flag: str) -> EnumT:
    try:
        return kind(value.lower())
    except ValueError:
        choices = ", ".join(member.value for member in kind)
        raise DeeppoolError(f"{flag} '{value}' is not one of {choices}") from None


def _mount_package_commands() -> None:
    """The executor's, the multiplexer's, the simulator's and the coordinator's commands, each in its own package.

    Their modules import only typer and the option types; each command loads torch and its work when it runs.
    """
    from deeppool.cluster_sim.cli import simulate, simulate_deeppool
    from deeppool.coordinator import cli as coordinator
    from deeppool.executor.launch.cli import export, profile_network
    from deeppool.multiplex.cli import app as multiplex_app
    from deeppool.replay.cli import replay
    from deeppool.run_command import RUN_SUMMARY, run

    app.command("run", short_help=RUN_SUMMARY)(run)
    app.add_typer(multiplex_app, name="multiplex")
    app.command("profile-network")(profile_network)
    app.command("export")(export)
    app.command("simulate")(simulate)
    app.command("simulate-deeppool")(simulate_deeppool)
    app.command("replay")(replay)
    app.command("serve")(coordinator.serve)
    app.add_typer(coordinator.token_app, name="token")
    for command in (coordinator.submit, coordinator.jobs, coordinator.logs, coordinator.cancel):
        app.command()(command)


_mount_package_commands()


def main(args: list[str] | None = None) -> None:
    """Entry point: user mistakes print one line starting ``error:`` and exit 2, never a traceback."""
    from deeppool.entry import run_app

    run_app(app, args, prog_name="deeppool")


if __name__ == "__main__":
    main()
