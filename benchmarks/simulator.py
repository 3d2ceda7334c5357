"""Benchmark of the cluster simulator: the full Philly-derived trace on 2,048 GPUs, and loaded on 256.

Replays every job of ``traces/philly.csv`` (Pollux OSDI'21 artifact,
petuum/adaptdl osdi21-artifact, Apache-2.0; derived from the Microsoft Philly
traces, msr-fiddle/philly-traces, CC-BY-4.0) under the default policy (``burst+demand``), and under
``dp`` in the same run as the baseline, on each ``--gpus`` cluster of A100s in
nodes of 8: by default 2,048 (the trace's own scale: lightly loaded) and 256
(loaded: queues of thousands of jobs, background work on lent ranks). Reports
the time of every stage, events per second, and the wall-time ratio of
the default policy to ``dp``. The target is <= 60 s end to end for the default policy on
2,048 GPUs.

Plans are read from the on-disk plan cache when present (the first run on a
new planner version traces the four examples and solves ~36 ILPs; that
one-off cost is reported as "plans" with the number of solves). Pass
``--cold`` to use an empty cache and measure it.

    python benchmarks/simulator.py [--trace PATH] [--gpus 2048 --gpus 256] [--cold] [--json out.json] [--write-docs]
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from deeppool.cluster_sim.cli import DEFAULT_CACHE, DEFAULT_POLICY
from deeppool.cluster_sim.cluster import ClusterSpec
from deeppool.cluster_sim.metrics import compare, table
from deeppool.cluster_sim.models import default_mapping
from deeppool.cluster_sim.plans import PlanBook, PlanSettings
from deeppool.cluster_sim.runner import assign, for_pieces, run_policies, sim_jobs
from deeppool.cluster_sim.shipped import PHILLY
from deeppool.cluster_sim.workload import BackgroundRule, read_workload
from deeppool.docregions import REPO, Stamp, markdown, write_region
from deeppool.planner.profiling.interference import InterferenceModel, Pieces

BUDGET_S = 60.0
BUDGET_GPUS = 2048
"""The configuration the budget is for."""
POLICY, BASELINE = DEFAULT_POLICY, "dp"
INTERFERENCE = for_pieces(InterferenceModel(), Pieces())
"""``deeppool simulate``'s defaults: the assumed interference, plans lent for ``priority`` mode's pieces."""

app = typer.Typer(add_completion=False)


def _timed(stages: dict[str, float], name: str, action):
    started = time.perf_counter()
    value = action()
    stages[name] = time.perf_counter() - started
    return value


@app.command()
def main(
    trace: Annotated[Path, typer.Option(help="Philly-derived trace.")] = PHILLY,
    gpus: Annotated[list[int], typer.Option(help="GPUs in the cluster (repeat).")] = [2048, 256],  # noqa: B006
    gpus_per_node: Annotated[int, typer.Option(help="GPUs per node.")] = 8,
    cold: Annotated[bool, typer.Option("--cold", help="Start from an empty plan cache.")] = False,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the figures as JSON.")] = None,
    write_docs: Annotated[bool, typer.Option(
        "--write-docs", help="Also write the tables into docs/performance.md (region 'simulator').")] = False,
) -> None:
    console = Console(width=140)
    stamp = Stamp.started()
    cache = Path(tempfile.mkdtemp(prefix="deeppool-bench-")) if cold else DEFAULT_CACHE
    shown: list[Table | str] = []
    figures = [_bench(console, trace, ClusterSpec(gpus=count, gpus_per_node=gpus_per_node), cache, shown)
               for count in gpus]
    if json_out is not None:
        json_out.write_text(json.dumps(figures, indent=2) + "\n")
    if write_docs:
        body = "\n\n".join(markdown(item) if isinstance(item, Table) else item for item in shown)
        write_region(REPO / "docs" / "performance.md", "simulator", body, stamp)


def _bench(console: Console, trace: Path, cluster: ClusterSpec, cache: Path,
           shown: list[Table | str]) -> dict[str, object]:
    """One configuration: every stage timed, both policies simulated; the figures as a dict."""
    gpus = cluster.gpus
    stages: dict[str, float] = {}
    workload = _timed(stages, "read trace", lambda: read_workload(trace))
    assignment = _timed(stages, "map models", lambda: assign(
        workload, mapping=default_mapping(), rule=BackgroundRule(), cluster=cluster, seed=0, drop_oversized=False))
    book = PlanBook(cluster=cluster, settings=PlanSettings(interference=INTERFERENCE), cache_dir=cache)
    _timed(stages, "plans", lambda: book.prepare(assignment.needs(), workers=os.cpu_count() or 1))
    jobs = _timed(stages, "job work", lambda: sim_jobs(assignment, book))
    results = {}
    for name in (BASELINE, POLICY):
        (results[name],) = _timed(stages, f"simulate {name}", lambda n=name: run_policies(
            jobs, policies=(n,), cluster=cluster, book=book, interference=INTERFERENCE))
    shared = sum(stages[s] for s in ("read trace", "map models", "plans", "job work"))
    end_to_end = shared + stages[f"simulate {POLICY}"]
    budget = ""
    if gpus == BUDGET_GPUS:
        budget = f" ({'within' if end_to_end <= BUDGET_S else 'OVER'} the {BUDGET_S:.0f} s budget)"
    verdict = (f"{POLICY} on {gpus} GPUs end to end: {end_to_end:.1f} s{budget}; "
               f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}, "
               f"Python {platform.python_version()}")
    tables = [_stage_table(stages, book.solved, len(assignment.needs())), _engine_table(results),
              table(compare(list(results.values())), f"{len(jobs):,} Philly jobs on {cluster.describe()}")]
    for item in (*tables, verdict):
        console.print(item)
    shown.extend((f"**{gpus:,} GPUs**", *tables, verdict))
    return {
        "jobs": len(jobs), "gpus": gpus, "stages_s": stages, "plans_solved": book.solved,
        "end_to_end_s": end_to_end, "cpus": os.cpu_count(), "load_1min": os.getloadavg()[0],
        "engine": {n: {"events": r.events, "wall_s": r.wall_s, "events_per_s": r.events / r.wall_s}
                   for n, r in results.items()},
    }


def _stage_table(stages: dict[str, float], solved: int, needed: int) -> Table:
    out = Table(title="stages")
    out.add_column("stage")
    out.add_column("seconds", justify="right")
    for name, seconds in stages.items():
        label = f"{name} ({solved} of {needed} solved, rest cached)" if name == "plans" else name
        out.add_row(label, f"{seconds:.2f}")
    return out


def _engine_table(results) -> Table:
    out = Table(title=f"event loop: {POLICY} vs {BASELINE} (same run)")
    for column in ("policy", "events", "decisions", "wall (s)", "events/s", f"wall / {BASELINE}"):
        out.add_column(column, justify="left" if column == "policy" else "right")
    base = results[BASELINE].wall_s
    for name, r in results.items():
        out.add_row(name, f"{r.events:,}", f"{r.decisions:,}", f"{r.wall_s:.2f}", f"{r.events / r.wall_s:,.0f}",
                    f"{r.wall_s / base:.2f}x")
    return out


if __name__ == "__main__":
    app()
