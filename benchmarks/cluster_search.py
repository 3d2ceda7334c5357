"""The cluster objective's exact search on the simulator's DeepPool examples: proven or stopped, and how fast.

    python benchmarks/cluster_search.py [--models resnet50,vgg16] [--gpus 8,64,256] [--mux priority] [--write-docs]

For every example of ``deeppool simulate-deeppool`` (its foreground model at its batch on A100s) and GPU
count, the planner's ``--objective cluster`` search (:mod:`deeppool.planner.solve.throughput`) runs as the
simulator runs it: with the defaults of the interference model and the 30 s limit, once with the
guest's pieces (the 1-GPU background's piece under ``--mux``, default ``priority``: 0.5 ms, or one layer phase
of one row where longer, as the scenario sets it) and once without.
Each row gives the cluster throughput ``J`` of the plan found (over data parallel on all GPUs), whether
the search proved it best within the planner's 0.2% gap or stopped at its limit, and then how high its
bound still was, and the CPU seconds (a busy machine inflates the wall time far more).
The target: every search proven within the limit. ``--write-docs`` writes the table into
docs/performance.md (region 'cluster-search').
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from deeppool.cluster_sim.cluster import ClusterSpec
from deeppool.cluster_sim.models import EXAMPLE_BATCH, example
from deeppool.cluster_sim.plans import PlanBook, PlanSettings
from deeppool.cluster_sim.runner import piece_ms as guest_piece_ms
from deeppool.cluster_sim.scenario import scenario_models
from deeppool.docregions import REPO, Stamp, markdown, write_region
from deeppool.plans import Objective, Strategy
from deeppool.planner.api import PlanRequest, device_setup, plan_graph
from deeppool.planner.profiling.interference import InterferenceModel, PieceMode, Pieces

TIME_LIMIT_S = 30.0
"""The simulator's ``--plan-time-limit`` default."""


@dataclass(frozen=True, kw_only=True)
class Search:
    """One search: the plan's throughput, and what the search proved about it."""

    throughput: float
    proven: bool
    bound: float
    cpu_s: float


@dataclass(frozen=True, kw_only=True)
class Row:
    model: str
    gpus: int
    piece_ms: float
    pieces: Search
    without: Search


def _search(book: PlanBook, name: str, gpus: int, piece_ms: float) -> Search:
    foreground, _ = scenario_models(example(name), gpus)
    graph = book.graph(foreground)
    profile, _ = device_setup(book.cluster.device.value, foreground.global_batch, foreground.global_batch, graph)
    request = PlanRequest(gpus=gpus, global_batch=foreground.global_batch, strategy=Strategy.ILP,
                          time_limit_s=TIME_LIMIT_S, interference=InterferenceModel(bg_piece_ms=piece_ms),
                          interference_source="the simulator's interference model", objective=Objective.CLUSTER)
    started = time.process_time()
    plan = plan_graph(graph, profile, book.cluster.network, request, model=foreground.spec).plan
    cpu_s = time.process_time() - started
    assert plan.cluster is not None
    throughput = plan.cluster.fg_share + plan.cluster.bg_share
    proven = plan.solver.status.startswith("cluster throughput") and ", optimal" in plan.solver.status
    bound = throughput if proven else throughput / max(1e-12, 1 - plan.solver.gap)
    return Search(throughput=throughput, proven=proven, bound=bound, cpu_s=cpu_s)


def _row(book: PlanBook, name: str, gpus: int, pieces: Pieces) -> Row:
    _, background = scenario_models(example(name), gpus)
    piece_ms = guest_piece_ms(background, 1, book, pieces)
    return Row(model=name, gpus=gpus, piece_ms=piece_ms, pieces=_search(book, name, gpus, piece_ms),
               without=_search(book, name, gpus, 0.0))


def _cell(search: Search) -> list[str]:
    status = "proven" if search.proven else f"stopped, ≤ {search.bound:.3f}x"
    return [f"{search.throughput:.3f}x", status, f"{search.cpu_s:.1f}"]


def _table(rows: list[Row]) -> Table:
    table = Table(title=f"cluster objective's search, A100s, {TIME_LIMIT_S:.0f} s limit, gap 0.2%")
    for column in ("model", "GPUs", "guest's piece (ms)", "J with pieces", "search", "CPU s",
                   "J without pieces", "search ", "CPU s "):
        table.add_column(column)
    for row in rows:
        table.add_row(row.model, str(row.gpus), f"{row.piece_ms:.2f}", *_cell(row.pieces), *_cell(row.without))
    return table


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(EXAMPLE_BATCH))
    parser.add_argument("--gpus", default="8,64,256")
    parser.add_argument("--mux", default=PieceMode.PRIORITY.value, choices=[m.value for m in PieceMode])
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    console = Console()
    stamp = Stamp.started()
    book = PlanBook(cluster=ClusterSpec(gpus=8, gpus_per_node=8),
                    settings=PlanSettings(time_limit_s=TIME_LIMIT_S), cache_dir=None)
    rows = []
    for name in args.models.split(","):
        for gpus in (int(g) for g in args.gpus.split(",")):
            rows.append(_row(book, name, gpus, Pieces(mode=PieceMode(args.mux))))
            done = rows[-1]
            console.print(f"{name} on {gpus}: {done.pieces.throughput:.3f}x in {done.pieces.cpu_s:.1f} s CPU "
                          f"({'proven' if done.pieces.proven else 'stopped'}), load {_load()}")
    table = _table(rows)
    table.title = f"{table.title}, --mux {args.mux}"
    console.print(table)
    pieces, without = sum(row.pieces.proven for row in rows), sum(row.without.proven for row in rows)
    verdict = (f"{pieces} of {len(rows)} searches with the guest's pieces proven within the limit, "
               f"{without} of {len(rows)} without them (as `deeppool plan --objective cluster` searches)")
    console.print(verdict)
    if args.write_docs:
        write_region(REPO / "docs" / "performance.md", "cluster-search", f"{markdown(table)}\n\n{verdict}.",
                     stamp.finished())


if __name__ == "__main__":
    main()
