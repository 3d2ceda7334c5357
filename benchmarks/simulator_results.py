"""The result tables of ``docs/simulator.md``, from the documented ``deeppool simulate`` commands run now.

Each result runs its command as a user would (a real ``deeppool`` process on the shipped traces, with the
plan cache of ``~/.cache/deeppool``), reads the ``metrics.json`` or ``scenario.json`` it wrote, and prints
the table; ``--write-docs`` also writes it into its region of ``docs/simulator.md`` under a stamp with
the commit, date, machine and load.

``policies`` runs every policy of :data:`MATRIX_POLICIES` on every trace of :data:`MATRIX` and prints one table,
then whether the default policy meets its goals on each trace (issue 42).

    python benchmarks/simulator_results.py [--only workload-6 --only synthetic --only deeppool --only policies]
                                           [--write-docs]
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
        "--policy", "tiresias:burst+bg", "--policy", "burst+demand", "--policy", "pollux")),
    Result(name="synthetic", args=(
        "simulate", "synthetic", "--gpus", "64", "--jobs", "2000", "--arrival-rate", "40", "--size-mix",
        "1:0.5,8:0.2,16:0.2,32:0.1", "--policy", "burst", "--policy", "burst+prio", "--policy", "burst+bg",
        "--policy", "dp+bg", "--policy", "fifo-backfill", "--policy", "tiresias", "--policy", "tiresias:burst+prio",
        "--policy", "tiresias:burst+bg", "--policy", "burst+demand")),
    Result(name="deeppool", args=("simulate-deeppool",)),
    Result(name="policies", args=()),
)
DEFAULT = "burst+demand"
"""``deeppool simulate``'s default policy."""
BASELINES = ("dp", "burst", "burst+prio")
"""The policies the default must match: at least the best of their throughputs less 1%."""
MATRIX_POLICIES = ("burst", "burst+prio", "burst+bg", "fifo-backfill", DEFAULT)
MATRIX = (
    ("Philly, 256 GPUs", ("philly", "--gpus", "256")),
    ("workload-6, 64 GPUs", ("workload-6", "--gpus", "64", "--gpus-per-node", "4")),
    ("workload-3, 64 GPUs", ("workload-3", "--gpus", "64", "--gpus-per-node", "4")),
    ("workload-2, 64 GPUs", ("workload-2", "--gpus", "64", "--gpus-per-node", "4")),
    ("synthetic, loaded, 64 GPUs", ("synthetic", "--gpus", "64", "--jobs", "2000", "--arrival-rate", "40",
                                    "--size-mix", "1:0.5,8:0.2,16:0.2,32:0.1")),
    ("Philly, 2,048 GPUs", ("philly", "--gpus", "2048")),
)
THROUGHPUT_SLACK = 0.01
TAIL_SLACK = 0.05
"""The default's goals: cluster throughput at least the best baseline's less 1%; average JCT at most dp's; the
p50 and p99 JCT of the background (demoted) jobs and of the others at most 5% above dp's."""
app = typer.Typer(add_completion=False)


@app.command()
def main(
    only: Annotated[list[str], typer.Option(help="Results to run (repeat): workload-6, synthetic, deeppool, "
                                                "policies.")] = [],  # noqa: B006
    write_docs: Annotated[bool, typer.Option("--write-docs", help=f"Write each table into {DOC.name}.")] = False,
) -> None:
    console = Console(width=200)
    chosen = [result for result in RESULTS if not only or result.name in only]
    for result in chosen:
        stamp = Stamp.started()
        if result.name == "policies":
            tables, wall_s, commands = _matrix()
            for shown in tables:
                console.print(shown)
            if write_docs:
                body = "\n".join(f"`{c}`" + "  " for c in commands) + f"\n\n({wall_s:.0f} s in all)\n\n" + \
                    "\n\n".join(markdown(t) for t in tables)
                write_region(DOC, "simulator-policies", body, stamp)
                console.print(f"wrote region 'simulator-policies' of {DOC}")
            continue
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


def _matrix() -> tuple[list[Table], float, list[str]]:
    """Every policy of MATRIX_POLICIES (and dp) on every trace of MATRIX: one table, and the default's goals."""
    started = time.perf_counter()
    runs, commands = [], []
    for label, trace in MATRIX:
        args = ("simulate", *trace, *(a for name in MATRIX_POLICIES for a in ("--policy", name)))
        commands.append(shlex.join(["deeppool", *args]))
        with tempfile.TemporaryDirectory(prefix="deeppool-results-") as folder:
            out = Path(folder) / "out"
            subprocess.run([sys.executable, "-m", "deeppool.cli", *args, "--out", str(out), "--no-plots"], check=True,
                           stdout=subprocess.DEVNULL)
            metrics = {name: PolicyMetrics(**m) for name, m in json.loads((out / "metrics.json").read_text()).items()}
        runs.append((label, metrics))
    return [_policy_table(runs), _goals_table(runs)], time.perf_counter() - started, commands


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:,.2f}"


def _policy_table(runs: list[tuple[str, dict[str, PolicyMetrics]]]) -> Table:
    out = Table(title="every policy on every trace (A100s, assumed interference, priority mode's 0.5 ms pieces)")
    columns = ("trace", "policy", "throughput vs dp", "avg JCT (h)", "p99 JCT (h)", "others' JCT p50/p99 (h)",
               "background JCT p50/p99 (h)", "lent GPU-h", "bg GPU-h in windows", "re-plans", "preempted/evicted")
    for column in columns:
        out.add_column(column, justify="left" if column in ("trace", "policy") else "right")
    for label, metrics in runs:
        for name, m in metrics.items():
            out.add_row(label, f"**{name}**" if name == DEFAULT else name, f"{m.cluster_throughput_vs_dp:.3f}x",
                        _hours(m.avg_jct_s), _hours(m.p99_jct_s),
                        f"{_hours(m.p50_fg_jct_s)}/{_hours(m.p99_fg_jct_s)}",
                        f"{_hours(m.p50_bg_jct_s)}/{_hours(m.p99_bg_jct_s)}",
                        f"{m.lent_gpu_seconds / 3600:,.1f}", f"{m.bg_gpu_seconds_in_windows / 3600:,.1f}",
                        str(m.replans), f"{m.preemptions}/{m.evictions}")
    out.caption = ("throughput: the work of every job over the makespan, over dp's; the background jobs are the "
                   "one-GPU ones (--background gpus<=1), the others every other job; lent GPU-h: idle ranks held by "
                   "guests; bg GPU-h in windows: the work they did there")
    return out


def _goals_table(runs: list[tuple[str, dict[str, PolicyMetrics]]]) -> Table:
    """Whether the default meets each goal on each trace, with the figure that decides it."""
    out = Table(title=f"the default policy ({DEFAULT}) against its goals")
    for column in ("trace", f"throughput ≥ best of {', '.join(BASELINES)} − 1%", "avg JCT ≤ dp's",
                   "others' p50/p99 ≤ dp's + 5%", "background p50/p99 ≤ dp's + 5%"):
        out.add_column(column)
    for label, metrics in runs:
        d, dp = metrics[DEFAULT], metrics["dp"]
        best_name = max(BASELINES, key=lambda name: metrics[name].cluster_throughput)
        best = metrics[best_name].cluster_throughput
        ratio = d.cluster_throughput / best
        tails = []
        for p50, p99 in (("p50_fg_jct_s", "p99_fg_jct_s"), ("p50_bg_jct_s", "p99_bg_jct_s")):
            worst = max(_over(getattr(d, p50), getattr(dp, p50)), _over(getattr(d, p99), getattr(dp, p99)))
            tails.append(f"{_met(worst <= 1 + TAIL_SLACK)} (worst {worst - 1:+.1%})")
        out.add_row(label, f"{_met(ratio >= 1 - THROUGHPUT_SLACK)} ({ratio - 1:+.1%} vs {best_name})",
                    f"{_met(d.avg_jct_s <= dp.avg_jct_s * (1 + 1e-9))} ({d.avg_jct_s / dp.avg_jct_s - 1:+.1%})",
                    *tails)
    return out


def _over(value: float, base: float) -> float:
    return value / base if base > 0 else (1.0 if value <= 0 else float("inf"))


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


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
