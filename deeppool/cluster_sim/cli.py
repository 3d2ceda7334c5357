"""``deeppool simulate``: replay a trace on a simulated cluster under one or more policies."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from deeppool.cluster_sim.cluster import ClusterSpec
from deeppool.cluster_sim.interference import (
    DEFAULT_BG_EFFICIENCY,
    DEFAULT_FG_SLOWDOWN,
    DEFAULT_MIN_LEND_FRACTION,
    InterferenceModel,
)
from deeppool.cluster_sim.metrics import compare, table, write_jobs, write_metrics
from deeppool.cluster_sim.models import default_mapping, load_mapping
from deeppool.cluster_sim.plans import PlanBook, PlanSettings
from deeppool.cluster_sim.policies import BASELINE, POLICIES, policy_named
from deeppool.cluster_sim.runner import assign, run_policies, sim_jobs
from deeppool.cluster_sim.workload import (
    BackgroundRule,
    SyntheticSpec,
    Workload,
    parse_size_mix,
    read_workload,
    synthetic,
)
from deeppool.errors import DeeppoolError
from deeppool.planner.hardware import known_device
from deeppool.planner.plan import Strategy

app = typer.Typer(add_completion=False, help="Simulate a GPU cluster running a job trace.")
SYNTHETIC = "synthetic"
TABLE_WIDTH = 120
DEFAULT_CACHE = Path.home() / ".cache" / "deeppool" / "cluster_sim"


@app.command()
def simulate(
    trace: Annotated[str, typer.Argument(help="Philly-derived or Pollux workload CSV, or 'synthetic'.")],
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs in the cluster.")],
    gpus_per_node: Annotated[int, typer.Option("--gpus-per-node", help="GPUs per node.")] = 8,
    device: Annotated[str, typer.Option("--device", help="Device model of every GPU: v100, a100, h100.")] = "a100",
    policy: Annotated[list[str], typer.Option("--policy", help=f"Policy to run (repeat): {', '.join(POLICIES)}.")] = ["burst+bg"],  # noqa: B006
    out: Annotated[Path, typer.Option("--out", help="Folder for metrics.json/csv, jobs.csv and the plots.")] = Path("sim-results"),
    seed: Annotated[int, typer.Option("--seed", help="Seeds model draws and synthetic workloads.")] = 0,
    mapping: Annotated[Path | None, typer.Option("--mapping", help="JSON: workload key -> {model, global_batch}.")] = None,
    background: Annotated[str, typer.Option("--background", help="Background jobs: gpus<=N, app:A[,B], column, none.")] = "gpus<=1",
    fg_slowdown: Annotated[float, typer.Option(help="Foreground iteration-time factor while hosting background work.")] = DEFAULT_FG_SLOWDOWN,
    bg_efficiency: Annotated[float, typer.Option(help="Share of lent idle time a background job turns into progress.")] = DEFAULT_BG_EFFICIENCY,
    min_lend_fraction: Annotated[float, typer.Option(help="Ranks idle for less of an iteration are not lent.")] = DEFAULT_MIN_LEND_FRACTION,
    burst_strategy: Annotated[str, typer.Option(help="Burst plans: ilp or deeppool.")] = "ilp",
    plan_time_limit: Annotated[float, typer.Option(help="ILP time limit per plan (s).")] = 30.0,
    cache_dir: Annotated[Path, typer.Option(help="Where traced graphs and plans are cached.")] = DEFAULT_CACHE,
    plan_workers: Annotated[int, typer.Option(help="Processes that solve missing plans (one model each).")] = os.cpu_count() or 1,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="Neither read nor write the plan cache.")] = False,
    pollux_traces: Annotated[Path | None, typer.Option(help="The Pollux artifact's traces/ folder (for run times).")] = None,
    drop_oversized: Annotated[bool, typer.Option("--drop-oversized", help="Drop jobs asking for more GPUs than the cluster has.")] = False,
    no_baseline: Annotated[bool, typer.Option("--no-baseline", help=f"Do not add the '{BASELINE}' baseline run.")] = False,
    no_plots: Annotated[bool, typer.Option("--no-plots", help="Skip the PNG plots.")] = False,
    jobs: Annotated[int, typer.Option(help="synthetic: number of jobs.")] = 200,
    arrival_rate: Annotated[float, typer.Option(help="synthetic: arrivals per hour.")] = 20.0,
    size_mix: Annotated[str, typer.Option(help="synthetic: GPUS:WEIGHT,...")] = "1:0.6,2:0.1,4:0.1,8:0.1,16:0.1",
    median_duration: Annotated[float, typer.Option(help="synthetic: median recorded run time (s).")] = 3600.0,
) -> None:
    """Replay TRACE on --gpus GPUs under each --policy; write metrics, tables and plots to --out."""
    console = Console(stderr=True)
    try:
        cluster = ClusterSpec(gpus=gpus, gpus_per_node=gpus_per_node, device=known_device(device))
        policies = _policies(policy, no_baseline)
        interference = InterferenceModel(
            fg_slowdown=fg_slowdown, bg_efficiency=bg_efficiency, min_lend_fraction=min_lend_fraction
        )
        settings = PlanSettings(burst_strategy=_strategy(burst_strategy), time_limit_s=plan_time_limit)
        rule = BackgroundRule.parse(background)
        workload = _workload(trace, pollux_traces, SyntheticSpec(
            jobs=jobs, arrivals_per_hour=arrival_rate, size_mix=parse_size_mix(size_mix),
            median_duration_s=median_duration, seed=seed,
        ))
        chosen = load_mapping(mapping) if mapping is not None else default_mapping()
        assignment = assign(workload, mapping=chosen, rule=rule, cluster=cluster, seed=seed, drop_oversized=drop_oversized)
        book = PlanBook(cluster=cluster, settings=settings, cache_dir=None if no_cache else cache_dir)
        with _progress(console) as progress:
            needs = assignment.needs()
            planning = progress.add_task("plans (model x GPUs)", total=len(needs))
            book.prepare(needs, lambda done: progress.advance(planning, done), workers=plan_workers)
            sim = sim_jobs(assignment, book)
            results = run_policies(sim, policies=policies, cluster=cluster, book=book, interference=interference,
                                   progress=_job_counter(progress, len(sim)))
    except DeeppoolError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)  # SystemExit: also leaves a host CLI run with standalone_mode=False
    metrics = compare(results)
    write_metrics(metrics, out)
    write_jobs(results, out)
    _write_run(out, workload, assignment.dropped, cluster, rule, interference, settings, seed, len(sim), book.solved)
    if not no_plots:
        from deeppool.cluster_sim.plots import write_plots

        write_plots(results, out)
    title = f"{Path(workload.source).name}: {len(sim):,} jobs on {cluster.describe()}"
    Console(width=None if sys.stdout.isatty() else TABLE_WIDTH).print(table(metrics, title))
    if assignment.dropped:
        console.print(f"dropped {assignment.dropped} job(s) asking for more than {cluster.gpus} GPUs")
    console.print(f"wrote {out}/metrics.json, metrics.csv, jobs.csv{'' if no_plots else ', utilisation.png, jct_cdf.png'}")


def _policies(requested: list[str], no_baseline: bool) -> tuple[str, ...]:
    names = [policy_named(name).name for name in requested]
    if not no_baseline and BASELINE not in names:
        names.insert(0, BASELINE)
    return tuple(dict.fromkeys(names))


def _strategy(text: str) -> Strategy:
    try:
        return Strategy(text)
    except ValueError:
        raise DeeppoolError(f"--burst-strategy '{text}': use ilp or deeppool") from None


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


def _write_run(out, workload, dropped, cluster, rule, interference, settings, seed, jobs, solved) -> None:
    """run.json: what was simulated, for reproducing it."""
    payload = {
        "trace": workload.source,
        "format": workload.format.value,
        "jobs": jobs,
        "dropped_oversized": dropped,
        "cluster": {"gpus": cluster.gpus, "gpus_per_node": cluster.gpus_per_node, "device": cluster.device.value},
        "background": rule.describe(),
        "interference": {"fg_slowdown": interference.fg_slowdown, "bg_efficiency": interference.bg_efficiency,
                         "min_lend_fraction": interference.min_lend_fraction},
        "burst_strategy": settings.burst_strategy.value,
        "seed": seed,
        "plans_solved_this_run": solved,
        "data": "traces: Pollux OSDI'21 artifact (petuum/adaptdl osdi21-artifact, Apache-2.0); "
                "philly.csv derived from Microsoft Philly traces (msr-fiddle/philly-traces, CC-BY-4.0)",
    }
    (out / "run.json").write_text(json.dumps(payload, indent=2) + "\n")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
