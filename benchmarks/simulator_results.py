"""The result tables of ``docs/simulator.md``, from the documented ``deeppool simulate`` commands run now.

Each result runs its command as a user would (a real ``deeppool`` process on the shipped traces, with the
plan cache of ``~/.cache/deeppool``), reads the ``metrics.json`` or ``scenario.json`` it wrote, and prints
the table; ``--write-docs`` also writes it into its region of ``docs/simulator.md`` under a stamp with
the commit, date, machine and load.

    python benchmarks/simulator_results.py [--only workload-6 --only synthetic --only deeppool] [--write-docs]
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from deeppool.cluster_sim.metrics import PolicyMetrics, scenario_table, table
from deeppool.cluster_sim.scenario import PAPER_RANGE, ScenarioPoint
from deeppool.docregions import REPO, Stamp, markdown, write_region

DOC = REPO / "docs" / "simulator.md"
PUBLISHED_JCT_H = {"tiresias": ("Tiresias+TunedJobs", 0.96), "pollux": ("Pollux", 0.68)}
"""Average JCT on workload-6 at 64 GPUs: Pollux OSDI'21 artifact, results-jobload/{tiresias,pollux}-1.0/summary.json."""


@dataclass(frozen=True, kw_only=True)
class Result:
    name: str
    args: tuple[str, ...]

    def command(self) -> str:
        return shlex.join(["deeppool", *self.args])


RESULTS = (
    Result(name="workload-6", args=(
        "simulate", "workload-6", "--gpus", "64", "--gpus-per-node", "4", "--policy", "fifo-backfill",
        "--policy", "tiresias", "--policy", "burst", "--policy", "burst+prio", "--policy", "burst+bg",
        "--policy", "tiresias:burst+bg", "--policy", "pollux")),
    Result(name="synthetic", args=(
        "simulate", "synthetic", "--gpus", "64", "--jobs", "2000", "--arrival-rate", "40", "--size-mix",
        "1:0.5,8:0.2,16:0.2,32:0.1", "--policy", "burst", "--policy", "burst+prio", "--policy", "burst+bg",
        "--policy", "dp+bg", "--policy", "fifo-backfill", "--policy", "tiresias", "--policy", "tiresias:burst+prio",
        "--policy", "tiresias:burst+bg")),
    Result(name="deeppool", args=("simulate-deeppool",)),
)
app = typer.Typer(add_completion=False)


@app.command()
def main(
    only: Annotated[list[str], typer.Option(help="Results to run (repeat): workload-6, synthetic, deeppool.")] = [],  # noqa: B006
    write_docs: Annotated[bool, typer.Option("--write-docs", help=f"Write each table into {DOC.name}.")] = False,
) -> None:
    console = Console(width=200)
    chosen = [result for result in RESULTS if not only or result.name in only]
    for result in chosen:
        stamp = Stamp.started()
        tables, wall_s = _run(result)
        for shown in tables:
            console.print(shown)
        console.print(f"{result.command()}: {wall_s:.1f} s")
        if write_docs:
            body = f"`{result.command()}` ({wall_s:.0f} s):\n\n" + "\n\n".join(markdown(t) for t in tables)
            write_region(DOC, f"simulator-{result.name}", body, stamp)
            console.print(f"wrote region 'simulator-{result.name}' of {DOC}")


def _run(result: Result) -> tuple[list[Table], float]:
    with tempfile.TemporaryDirectory(prefix="deeppool-results-") as folder:
        out = Path(folder) / "out"
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "deeppool.cli", *result.args, "--out", str(out)]
                       + (["--no-plots"] if result.args[0] == "simulate" else []), check=True, stdout=subprocess.DEVNULL)
        wall_s = time.perf_counter() - started
        if result.args[0] == "simulate-deeppool":
            points = [ScenarioPoint(**point) for point in json.loads((out / "scenario.json").read_text())]
            low, high = PAPER_RANGE
            return [scenario_table(points, f"{low}-{high}x")], wall_s
        metrics = [PolicyMetrics(**m) for m in json.loads((out / "metrics.json").read_text()).values()]
        jobs = json.loads((out / "run.json").read_text())["jobs"]
        tables = [table(metrics, f"{result.name}: {jobs:,} jobs on {result.args[3]} GPUs")]
        if result.name == "workload-6":
            tables.insert(0, _published(metrics))
        return tables, wall_s


def _published(metrics: list[PolicyMetrics]) -> Table:
    """The artifact's published average JCTs beside this run's, for the schedulers both have."""
    by_policy = {m.policy: m for m in metrics}
    out = Table(title="published (Pollux OSDI'21 artifact) vs deeppool simulate, average JCT")
    for column in ("scheduler", "published (h)", "deeppool simulate (h)", "difference"):
        out.add_column(column)
    for policy, (scheduler, published) in PUBLISHED_JCT_H.items():
        ours = by_policy[policy].avg_jct_s / 3600
        out.add_row(scheduler, f"{published:.2f}", f"`{policy}`: {ours:.2f}", f"{ours / published - 1:+.0%}")
    return out


if __name__ == "__main__":
    app()
