"""``deeppool simulate``: replay a trace on a simulated cluster under one or more policies."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from deeppool import checks
from deeppool.cluster_sim.cluster import ClusterSpec
from deeppool.cluster_sim.engine import SimResult
from deeppool.cluster_sim.metrics import compare, scenario_table, table, write_jobs, write_metrics
from deeppool.cluster_sim.models import EXAMPLE_BATCH, default_mapping, example, load_mapping
from deeppool.cluster_sim.plans import BurstStrategy, PlanBook, PlanSettings
from deeppool.cluster_sim.pollux import PolluxDurations
from deeppool.cluster_sim.runner import (
    DEFAULT_REPLAN_PENALTY_S, DEFAULT_RESTART_PENALTY_S, assign, for_pieces, run_policies, sim_jobs,
)
from deeppool.cluster_sim.shipped import resolve, shipped
from deeppool.cluster_sim.workload import (
    BackgroundRule,
    SyntheticSpec,
    TraceFormat,
    TraceJob,
    Workload,
    parse_size_mix,
    read_workload,
    synthetic,
)
from deeppool.errors import DeeppoolError
from deeppool.interrupt import removes_if_interrupted
from deeppool.output import console as stdout
from deeppool.plans import Objective
from deeppool.planner.hardware import KnownDevice, known_device
from deeppool.planner.profiling.interference import (
    DEFAULT_BG_EFFICIENCY,
    DEFAULT_FG_SLOWDOWN,
    DEFAULT_MIN_LEND_FRACTION,
    DEFAULT_PIECE_MS,
    InterferenceModel,
    PieceMode,
    Pieces,
)
from deeppool.scheduling.contract import SpeedModel
from deeppool.scheduling.policies import ADAPTIVE, BASELINE, POLICIES, policy_named

app = typer.Typer(add_completion=False, help="Simulate a GPU cluster running a job trace.")
SYNTHETIC = "synthetic"
DEFAULT_POLICY = "burst+demand"
ATTRIBUTION = (
    "traces: Pollux OSDI'21 artifact (petuum/adaptdl osdi21-artifact, Apache-2.0); "
    "philly.csv derived from the Microsoft Philly traces (msr-fiddle/philly-traces, CC-BY-4.0)"
)
DEFAULT_CACHE = Path.home() / ".cache" / "deeppool" / "cluster_sim"


TraceArg = Annotated[str, typer.Argument(
    help="Philly-derived or Pollux workload CSV, a shipped trace's name (philly, workload-6...), or 'synthetic'.")]
GpusOpt = Annotated[int, typer.Option("--gpus", help="GPUs in the cluster.")]
NodeOpt = Annotated[int, typer.Option("--gpus-per-node", help="GPUs per node.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="Device model of every GPU: v100, a100, h100, h200.")]
PolicyOpt = Annotated[list[str], typer.Option(
    "--policy", help=f"Policy to run (repeat): [ORDER:]PLACEMENT or ORDER, one of {', '.join(POLICIES)} "
         "(pollux: GPUs and batch sizes for goodput; Pollux workloads only).")]
OutOpt = Annotated[Path, typer.Option("--out", help="Folder for metrics.json/csv, jobs.csv and the plots.")]
ForceOpt = Annotated[bool, typer.Option("--force", help="Replace an earlier run's files in --out (without it, a "
                                        "folder holding one is refused).")]
RUN_FILES = ("metrics.json", "metrics.csv", "jobs.csv", "run.json", "utilisation.png", "jct_cdf.png", "throughput.png")
"""What ``simulate`` writes into --out (the last three unless --no-plots)."""
SCENARIO_FILES = ("scenario.json",)
"""What ``simulate-deeppool`` writes into --out."""
SeedOpt = Annotated[int, typer.Option("--seed", help="Seeds model draws and synthetic workloads.")]
MappingOpt = Annotated[Path | None, typer.Option("--mapping", help="JSON: workload key -> {model, global_batch}.")]
BackgroundOpt = Annotated[str, typer.Option("--background", help="Background jobs: gpus<=N, app:A[,B], column, none.")]
SlowdownOpt = Annotated[float, typer.Option(help="Foreground iteration-time factor while hosting background work.")]
EfficiencyOpt = Annotated[float, typer.Option(help="Share of lent idle time a background job turns into progress.")]
InterferenceOpt = Annotated[Path | None, typer.Option(
    "--interference", help="Measured interference.json (`deeppool multiplex bench`): replaces --fg-slowdown and "
    "--bg-efficiency.")]
LendOpt = Annotated[float, typer.Option(help="Ranks idle for less of an iteration are not lent.")]
RestartOpt = Annotated[float, typer.Option(
    "--restart-penalty", help="Seconds lost each time a preempted or evicted job runs again.")]
ReplanOpt = Annotated[float, typer.Option(
    "--replan-penalty", help="Seconds a running job loses when a policy moves it to another plan (an assumption: a "
    "restart's).")]
MuxOpt = Annotated[str | None, typer.Option(
    "--mux", help="The multiplexing mode that runs background work, which sets its pieces: priority (CUDA-graph pieces "
    "of --piece-ms, at least one layer phase of one row; the default, or the mode of --interference), gate "
    "(micro-steps of whole rows) or layer (whole layer phases at the guest's batch).")]
PieceOpt = Annotated[float, typer.Option(
    "--piece-ms", help="--mux priority: the length background steps are cut to (DeepPool's be_graph_split_ms).")]
StrategyOpt = Annotated[str, typer.Option(help="Burst plans: ilp or deeppool.")]
ObjectiveOpt = Annotated[str, typer.Option(
    "--plan-objective", help="The lending plans (burst+bg lends them; burst+demand moves a job to its lending plan "
    "when the background waiting makes it worth it): cluster (the plan maximising the cluster's throughput under "
    "the interference model) or time (the fastest plan).")]
TimeLimitOpt = Annotated[float, typer.Option(help="ILP time limit per plan (s).")]
CacheOpt = Annotated[Path, typer.Option(help="Where traced graphs and plans are cached.")]
WorkersOpt = Annotated[int, typer.Option(help="Processes that solve missing plans (one model each).")]
NoCacheOpt = Annotated[bool, typer.Option("--no-cache", help="Neither read nor write the plan cache.")]
PolluxOpt = Annotated[Path | None, typer.Option(help="The Pollux artifact's traces/ folder (for run times).")]
DropOpt = Annotated[bool, typer.Option("--drop-oversized", help="Drop jobs asking for more GPUs than exist.")]
NoBaselineOpt = Annotated[bool, typer.Option("--no-baseline", help=f"Do not add the '{BASELINE}' baseline run.")]
NoPlotsOpt = Annotated[bool, typer.Option("--no-plots", help="Skip the PNG plots.")]
JobsOpt = Annotated[int, typer.Option(help="synthetic: number of jobs.")]
RateOpt = Annotated[float, typer.Option(help="synthetic: arrivals per hour.")]
MixOpt = Annotated[str, typer.Option(help="synthetic: GPUS:WEIGHT,...")]
DurationOpt = Annotated[float, typer.Option(help="synthetic: median recorded run time (s).")]


def _list_traces(wanted: bool) -> None:
    if wanted:
        for entry in shipped():
            print(entry.describe())
        print(ATTRIBUTION)
        raise typer.Exit()


ListOpt = Annotated[bool, typer.Option(
    "--list-traces", is_eager=True, callback=_list_traces, help="List the shipped traces by name and exit.")]


@app.command()
@removes_if_interrupted("out")
def simulate(
    trace: TraceArg,
    gpus: GpusOpt,
    gpus_per_node: NodeOpt = 8,
    device: DeviceOpt = "a100",
    policy: PolicyOpt = [DEFAULT_POLICY],  # noqa: B006  (typer reads the default, never mutates it)
    out: OutOpt = Path("sim-results"),
    seed: SeedOpt = 0,
    mapping: MappingOpt = None,
    background: BackgroundOpt = "gpus<=1",
    fg_slowdown: SlowdownOpt = DEFAULT_FG_SLOWDOWN,
    bg_efficiency: EfficiencyOpt = DEFAULT_BG_EFFICIENCY,
    min_lend_fraction: LendOpt = DEFAULT_MIN_LEND_FRACTION,
    interference_file: InterferenceOpt = None,
    restart_penalty: RestartOpt = DEFAULT_RESTART_PENALTY_S,
    replan_penalty: ReplanOpt = DEFAULT_REPLAN_PENALTY_S,
    mux: MuxOpt = None,
    piece_ms: PieceOpt = DEFAULT_PIECE_MS,
    burst_strategy: StrategyOpt = "ilp",
    plan_objective: ObjectiveOpt = "cluster",
    plan_time_limit: TimeLimitOpt = 30.0,
    cache_dir: CacheOpt = DEFAULT_CACHE,
    plan_workers: WorkersOpt = os.cpu_count() or 1,
    no_cache: NoCacheOpt = False,
    pollux_traces: PolluxOpt = None,
    drop_oversized: DropOpt = False,
    no_baseline: NoBaselineOpt = False,
    no_plots: NoPlotsOpt = False,
    jobs: JobsOpt = 200,
    arrival_rate: RateOpt = 20.0,
    size_mix: MixOpt = "1:0.6,2:0.1,4:0.1,8:0.1,16:0.1",
    median_duration: DurationOpt = 3600.0,
    list_traces: ListOpt = False,
    force: ForceOpt = False,
) -> None:
    """Replay TRACE on --gpus GPUs under each --policy; write metrics, tables and plots to --out."""
    console = stdout(stderr=True)
    try:
        checks.out_folder(out, "--out")
        earlier = _earlier_run(out, RUN_FILES, force=force)
        if not no_cache:
            checks.out_folder(cache_dir, "--cache-dir")
        if trace != SYNTHETIC:
            trace = str(resolve(trace))
        checks.existing_file(mapping, "--mapping")
        checks.at_least(plan_workers, 1, "--plan-workers")
        checks.positive(plan_time_limit, "--plan-time-limit")
        cluster = ClusterSpec(gpus=gpus, gpus_per_node=gpus_per_node, device=_device(device))
        policies = _policies(policy, no_baseline)
        for flag, seconds in (("--restart-penalty", restart_penalty), ("--replan-penalty", replan_penalty)):
            if not 0 <= seconds < 86400:
                raise DeeppoolError(f"{flag} {seconds}: give seconds in [0, 86400)")
        pieces = _pieces(mux, piece_ms, interference_file)
        interference = for_pieces(_interference(interference_file, fg_slowdown, bg_efficiency, min_lend_fraction),
                                  pieces)
        settings = PlanSettings(burst_strategy=_strategy(burst_strategy), time_limit_s=plan_time_limit,
                                lending_objective=_objective(plan_objective), interference=interference)
        rule = BackgroundRule.parse(background)
        spec = SyntheticSpec(jobs=jobs, arrivals_per_hour=arrival_rate, size_mix=parse_size_mix(size_mix),
                             median_duration_s=median_duration, seed=seed)
        workload = _workload(trace, pollux_traces, spec)
        speeds = _speeds(workload, trace, pollux_traces, policies)
        chosen = (load_mapping(mapping) if mapping is not None
                  else default_mapping(spread=workload.format is TraceFormat.PHILLY))
        _replace(earlier)
        out.mkdir(parents=True, exist_ok=True)  # every option checked: now the work
        assignment = assign(workload, mapping=chosen, rule=rule, cluster=cluster, seed=seed,
                            drop_oversized=drop_oversized)
        book = PlanBook(cluster=cluster, settings=settings, cache_dir=None if no_cache else cache_dir)
        with _progress(console) as progress:
            planning = progress.add_task("plans (model x GPUs)", total=len(assignment.needs()))
            book.prepare(assignment.needs(), lambda done: progress.advance(planning, done), workers=plan_workers)
            sim = sim_jobs(assignment, book, speeds, pieces=pieces)
            results = run_policies(sim, policies=policies, cluster=cluster, book=book, interference=interference,
                                   restart_penalty_s=restart_penalty, replan_penalty_s=replan_penalty,
                                   progress=_job_counter(progress, len(sim)))
    except DeeppoolError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)  # SystemExit: also leaves a host CLI run with standalone_mode=False
    run = RunInfo(workload=workload, jobs=len(sim), dropped=assignment.dropped, cluster=cluster, rule=rule,
                  interference=interference, settings=settings, seed=seed, solved=book.solved,
                  restart_penalty_s=restart_penalty, replan_penalty_s=replan_penalty, pieces=pieces,
                  background_jobs=sum(job.background for job in sim))
    _report(results, run, out, console, plots=not no_plots)


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """What was simulated (written as run.json)."""

    workload: Workload
    jobs: int
    dropped: int
    cluster: ClusterSpec
    rule: BackgroundRule
    interference: InterferenceModel
    settings: PlanSettings
    seed: int
    solved: int
    restart_penalty_s: float
    replan_penalty_s: float = DEFAULT_REPLAN_PENALTY_S
    pieces: Pieces = Pieces()
    background_jobs: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "trace": self.workload.source,
            "format": self.workload.format.value,
            "jobs": self.jobs,
            "dropped_oversized": self.dropped,
            "cluster": {"gpus": self.cluster.gpus, "gpus_per_node": self.cluster.gpus_per_node,
                        "device": self.cluster.device.value},
            "background": self.rule.describe(),
            "interference": asdict(self.interference),
            "restart_penalty_s": self.restart_penalty_s,
            "replan_penalty_s": self.replan_penalty_s,
            "mux": self.pieces.mode.value,
            "piece_ms": self.pieces.target_ms,
            "pieces": self.pieces.describe(),
            "background_jobs": self.background_jobs,
            "burst_strategy": self.settings.burst_strategy.value,
            "plan_objective": self.settings.lending_objective.value,
            "seed": self.seed,
            "plans_solved_this_run": self.solved,
            "data": ATTRIBUTION,
        }


def _report(results: tuple[SimResult, ...], run: RunInfo, out: Path, console: Console, *, plots: bool) -> None:
    metrics = compare(results)
    write_metrics(metrics, out)
    write_jobs(results, out)
    (out / "run.json").write_text(json.dumps(run.to_json(), indent=2) + "\n")
    if plots:
        from deeppool.cluster_sim.plots import write_plots  # matplotlib only when plotting

        write_plots(results, metrics, out)
    title = f"{Path(run.workload.source).name}: {run.jobs:,} jobs on {run.cluster.describe()}"
    stdout().print(table(metrics, title))
    console.print(f"background jobs: {run.background_jobs:,} of {run.jobs:,} ({run.rule.describe()}, --background); "
                  f"pieces: {run.pieces.describe()} (--mux)", soft_wrap=True)
    if run.dropped:
        console.print(f"dropped {run.dropped} job(s) asking for more than {run.cluster.gpus} GPUs")
    files = ", ".join(RUN_FILES if plots else RUN_FILES[:4])
    console.print(f"wrote {out}/: {files}", soft_wrap=True)


def _policies(requested: list[str], no_baseline: bool) -> tuple[str, ...]:
    names = [policy_named(name).name for name in requested]
    if not no_baseline and BASELINE not in names:
        names.insert(0, BASELINE)
    return tuple(dict.fromkeys(names))


def _speeds(workload: Workload, trace: str, traces: Path | None,
            policies: tuple[str, ...]) -> Callable[[TraceJob], SpeedModel] | None:
    """Each job's speed model, from the Pollux artifact's measurements, when a co-adaptive policy runs."""
    adaptive = sorted(ADAPTIVE & set(policies))
    if not adaptive:
        return None
    if workload.format is not TraceFormat.POLLUX:
        raise DeeppoolError(f"--policy {adaptive[0]} chooses batch sizes from measured gradient statistics: give a "
                            f"Pollux workload (name,time,application,num_replicas,batch_size), not a "
                            f"{workload.format.value} trace")
    root = traces if traces is not None else Path(trace).resolve().parent.parent / "traces"
    if not root.is_dir():
        raise DeeppoolError(f"--policy {adaptive[0]} runs jobs by the Pollux artifact's measurements, and '{root}' "
                            "is not its traces/ folder: pass --pollux-traces DIR")
    durations = PolluxDurations(root=root)
    return lambda job: durations.application(job.key, where=job.where)


def _strategy(text: str) -> BurstStrategy:
    try:
        return BurstStrategy(text)
    except ValueError:
        raise DeeppoolError(f"--burst-strategy '{text}': use ilp or deeppool") from None


def _objective(text: str) -> Objective:
    if text not in (Objective.CLUSTER.value, Objective.TIME.value):
        raise DeeppoolError(f"--plan-objective '{text}': use cluster or time")
    return Objective(text)


def _device(text: str) -> KnownDevice:
    try:
        return known_device(text)
    except DeeppoolError as err:
        raise DeeppoolError(f"--device: {err}") from None


def _workload(trace: str, pollux_traces: Path | None, spec: SyntheticSpec) -> Workload:
    if trace == SYNTHETIC:
        return synthetic(spec)
    return read_workload(trace, pollux_traces=pollux_traces)


@contextmanager
def _progress(console: Console) -> Iterator[Progress]:
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        yield progress


def _job_counter(progress: Progress, total: int) -> Callable[[str], Callable[[int], None]]:
    def for_policy(name: str) -> Callable[[int], None]:
        task = progress.add_task(f"simulating {name}", total=total)
        return lambda done: progress.update(task, completed=done)

    return for_policy


ScenarioGpusOpt = Annotated[list[int], typer.Option("--gpus", help="GPU counts (repeat).")]
ScenarioModelOpt = Annotated[list[str], typer.Option("--model", help="Example models (repeat).")]


@removes_if_interrupted("out")
def simulate_deeppool(
    gpus: ScenarioGpusOpt = [8, 16, 32, 64, 128, 256],  # noqa: B006  (typer reads the default)
    model: ScenarioModelOpt = list(EXAMPLE_BATCH),  # noqa: B006
    gpus_per_node: NodeOpt = 8,
    device: DeviceOpt = "a100",
    fg_slowdown: SlowdownOpt = DEFAULT_FG_SLOWDOWN,
    bg_efficiency: EfficiencyOpt = DEFAULT_BG_EFFICIENCY,
    min_lend_fraction: LendOpt = DEFAULT_MIN_LEND_FRACTION,
    interference_file: InterferenceOpt = None,
    mux: MuxOpt = None,
    piece_ms: PieceOpt = DEFAULT_PIECE_MS,
    plan_objective: ObjectiveOpt = "cluster",
    plan_time_limit: TimeLimitOpt = 30.0,
    cache_dir: CacheOpt = DEFAULT_CACHE,
    out: OutOpt = Path("sim-results"),
    force: ForceOpt = False,
) -> None:
    """DeepPool's evaluation: one foreground job plus unlimited background jobs, per example and GPU count."""
    from deeppool.cluster_sim.scenario import PAPER_RANGE, evaluate

    try:
        checks.out_folder(out, "--out")
        earlier = _earlier_run(out, SCENARIO_FILES, force=force)
        checks.out_folder(cache_dir, "--cache-dir")
        checks.positive(plan_time_limit, "--plan-time-limit")
        interference = _interference(interference_file, fg_slowdown, bg_efficiency, min_lend_fraction)
        cluster = ClusterSpec(gpus=gpus_per_node, gpus_per_node=gpus_per_node, device=_device(device))
        _replace(earlier)
        out.mkdir(parents=True, exist_ok=True)
        settings = PlanSettings(time_limit_s=plan_time_limit, lending_objective=_objective(plan_objective),
                                interference=interference)
        book = PlanBook(cluster=cluster, settings=settings, cache_dir=cache_dir)
        pieces = _pieces(mux, piece_ms, interference_file)
        points = [evaluate(example(name), count, gpus_per_node=gpus_per_node, book=book, interference=interference,
                           pieces=pieces)
                  for name in model for count in gpus]
    except DeeppoolError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    (out / "scenario.json").write_text(json.dumps([asdict(p) for p in points], indent=2) + "\n")
    low, high = PAPER_RANGE
    stdout().print(scenario_table(points, f"{low}-{high}x"))
    print(f"wrote {out}/scenario.json", file=sys.stderr)


def _earlier_run(out: Path, files: tuple[str, ...], *, force: bool) -> tuple[Path, ...]:
    """The files of an earlier run in ``out`` (those this command writes), refused unless ``force``: one run
    never silently replaces another."""
    earlier = tuple(out / name for name in files if (out / name).is_file())
    if earlier and not force:
        raise DeeppoolError(f"--out '{out}' holds an earlier run ({', '.join(p.name for p in earlier)}): "
                            "give another --out, or --force to replace it")
    return earlier


def _replace(earlier: tuple[Path, ...]) -> None:
    """``--force``: the earlier run's files go (a plot it drew and this run does not draw is not left behind)."""
    for path in earlier:
        path.unlink()


def _pieces(mux: str | None, piece_ms: float, interference: Path | None) -> Pieces:
    """``--mux`` (else the mode ``--interference`` was measured in, when it cuts pieces; else ``priority``)."""
    if mux is None and interference is not None:
        try:
            measured = json.loads(interference.read_text()).get("mode")
        except (OSError, ValueError, AttributeError):
            measured = None  # what is wrong with the file, reading it as interference says
        mux = measured if measured in (PieceMode.PRIORITY.value, PieceMode.GATE.value) else None
    try:
        mode = PieceMode(mux or PieceMode.PRIORITY.value)
    except ValueError:
        raise DeeppoolError(f"--mux '{mux}': use {', '.join(m.value for m in PieceMode)}") from None
    return Pieces(mode=mode, target_ms=piece_ms)


def _interference(path: Path | None, slowdown: float, efficiency: float, lend: float) -> InterferenceModel:
    if path is not None:
        return InterferenceModel.measured(path, min_lend_fraction=lend)
    return InterferenceModel(fg_slowdown=slowdown, bg_efficiency=efficiency, min_lend_fraction=lend)


def main() -> None:
    from deeppool.entry import run_app

    run_app(app)


if __name__ == "__main__":
    main()
