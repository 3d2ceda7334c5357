"""Two ranks computing at once on a CPU host: the model's own step against the profiler's sharing figure.

    python benchmarks/core_sharing.py [--models hf_convnext,hf_bert,hf_vit] [--batch 16] [--turns 40]
                                      [--steps 15] [--write-docs]

The local profiler prices a stage on ``g`` ranks with ``sharing(g)``: how much slower ``g`` single-thread
workers doing 256×256 matmuls at once run than one alone (:func:`deeppool.planner.profiling.sharing.measure_sharing`).
The held-out fidelity benchmark's plans that compute on 2 ranks at once miss in both directions where
single-rank plans hold (``docs/performance.md``), so this asks whether the model's own step shares the
cores differently. Two processes (one intra-op thread each, as a rank of 2 on 2 cores) build a held-out
model of ``benchmarks/zoo`` at ``--batch`` samples (16: a 2-rank data-parallel plan of the zoo's global
batch of 32) and take turns, ``--turns`` times: process 0 alone, both at once, process 1 alone, each the
median of ``--steps`` forward+backward steps; then the profiler's matmul figure, once, in the same turn.
A turn's model sharing is the slower process's step together over the two alone (a synchronous stage waits
for its slower rank).

The table gives each model's step alone and together, both sharing figures (median and the 10th to 90th
percentiles over turns), the share of turns whose model sharing exceeds 1.15 (a step more than the
fidelity goal's ±15% off its one-core figure), and the model's median over the matmuls' (the baseline,
measured in the same run). The host's reference work (:func:`deeppool.planner.profiling.timing.reference_ms`) is
read before and after each model, and the kernel's stolen time (``/proc/stat``) over its turns.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Barrier
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from deeppool.docregions import REPO, Stamp, markdown, write_region
from deeppool.model.loading import load_model
from deeppool.plans import ModelSpec
from deeppool.planner.profiling.sharing import measure_sharing
from deeppool.planner.profiling.timing import intra_op_threads, reference_ms

ZOO = Path(__file__).resolve().parent / "zoo"
MODELS = "hf_convnext,hf_bert,hf_vit"
SLOW = 1.15
"""A turn whose model sharing exceeds this is a step more than the fidelity goal's ±15% off its one-core figure."""


@dataclass(frozen=True, kw_only=True)
class Turn:
    """One turn: each process's median step alone and together (ms), and the profiler's matmul figure."""

    alone: tuple[float, float]
    together: tuple[float, float]
    matmul: float

    @property
    def sharing(self) -> float:
        return max(self.together) / statistics.fmean(self.alone)


@dataclass(frozen=True, kw_only=True)
class Row:
    model: str
    turns: tuple[Turn, ...]
    reference: tuple[float, float]
    steal: int | None
    """Jiffies the hypervisor ran something else on this guest's CPUs during the turns (None: not readable)."""

    def model_sharing(self) -> list[float]:
        return [turn.sharing for turn in self.turns]

    def matmul_sharing(self) -> list[float]:
        return [turn.matmul for turn in self.turns]


def _step_worker(model_file: str, batch: int, conn: Connection, start: Barrier) -> None:
    """A rank's stand-in: the model's forward+backward on one intra-op thread, ``steps`` at a time on request."""
    torch.set_num_threads(1)
    loaded = load_model(ModelSpec.parse(model_file))
    module, inputs, targets = loaded.module, loaded.named_inputs(batch), loaded.targets(batch)

    def step() -> float:
        began = time.perf_counter()
        loaded.loss(module(**inputs), targets).backward()
        return 1e3 * (time.perf_counter() - began)

    for _ in range(3):
        step()
    conn.send("ready")
    while (request := conn.recv()) is not None:
        steps, together = request
        if together:
            start.wait()
        conn.send(statistics.median(step() for _ in range(steps)))


def measure(model: str, args: argparse.Namespace) -> Row:
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(2)
    pipes = [context.Pipe() for _ in range(2)]
    workers = [context.Process(target=_step_worker, args=(str(ZOO / f"{model}.py"), args.batch, child, start))
               for _, child in pipes]
    for worker in workers:
        worker.start()
    ours = [parent for parent, _ in pipes]
    for conn in ours:
        conn.recv()
    before, stolen = _reference(), steal_jiffies()
    turns = []
    for _ in range(args.turns):
        first = _ask(ours[0], args.steps, together=False)
        for conn in ours:
            conn.send((args.steps, True))
        together = (ours[0].recv(), ours[1].recv())
        second = _ask(ours[1], args.steps, together=False)
        matmul = measure_sharing((2,), 1, repeats=1)[2]  # on one intra-op thread per worker
        turns.append(Turn(alone=(first, second), together=together, matmul=matmul))
    for conn in ours:
        conn.send(None)
    for worker in workers:
        worker.join()
    after = steal_jiffies()
    steal = after - stolen if after is not None and stolen is not None else None
    return Row(model=model, turns=tuple(turns), reference=(before, _reference()), steal=steal)


def _ask(conn: Connection, steps: int, *, together: bool) -> float:
    conn.send((steps, together))
    return conn.recv()


def steal_jiffies(stat: Path = Path("/proc/stat")) -> int | None:
    """The kernel's count of stolen time over all CPUs (the 8th figure of /proc/stat's ``cpu`` line)."""
    try:
        fields = stat.read_text().splitlines()[0].split()
        return int(fields[8]) if fields[0] == "cpu" and len(fields) > 8 else None
    except (OSError, ValueError, IndexError):
        return None


def _reference() -> float:
    with intra_op_threads(1):
        return reference_ms()


def _spread(values: list[float]) -> str:
    deciles = statistics.quantiles(values, n=10)
    return f"{statistics.median(values):.2f} ({deciles[0]:.2f}-{deciles[-1]:.2f})"


def table(rows: list[Row], args: argparse.Namespace) -> Table:
    out = Table(title=f"two ranks computing at once, {args.batch} samples each, {args.turns} turns of "
                      f"{args.steps} steps", caption=f"'slow turns': model sharing above {SLOW}; 'model / "
                                                     "matmul': the model's median over the matmuls' (the "
                                                     "profiler's figure, measured in the same turns)")
    for header in ("model", "step alone (ms)", "step together (ms)", "model sharing", "slow turns",
                   "matmul sharing", "model / matmul", "host reference (ms)", "steal (jiffies)"):
        out.add_column(header)
    for row in rows:
        model, matmul = row.model_sharing(), row.matmul_sharing()
        alone = [ms for turn in row.turns for ms in turn.alone]
        together = [max(turn.together) for turn in row.turns]
        out.add_row(row.model, f"{statistics.median(alone):.2f}", f"{statistics.median(together):.2f}",
                    _spread(model), f"{sum(s > SLOW for s in model)} of {len(model)}", _spread(matmul),
                    f"{statistics.median(model) / statistics.median(matmul):.2f}x",
                    f"{row.reference[0]:.1f} → {row.reference[1]:.1f}", "-" if row.steal is None else str(row.steal))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=MODELS, help=f"held-out models of benchmarks/zoo (default {MODELS})")
    parser.add_argument("--batch", type=int, default=16, help="samples per process")
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--steps", type=int, default=15, help="steps per timing (their median)")
    parser.add_argument("--write-docs", action="store_true",
                        help="also write the table into docs/performance.md (region 'core-sharing')")
    args = parser.parse_args()
    if args.batch < 1 or args.turns < 2 or args.steps < 1:
        parser.error("--batch and --steps must be at least 1, --turns at least 2")
    unknown = [m for m in args.models.split(",") if not (ZOO / f"{m}.py").is_file()]
    if unknown:
        parser.error(f"--models {unknown[0]}: no such held-out model in benchmarks/zoo")
    stamp = Stamp.started()
    console = Console(width=180)
    rows = []
    for model in args.models.split(","):
        rows.append(measure(model, args))
        console.print(f"{model}: {len(rows[-1].turns)} turns, load {os.getloadavg()[0]:.2f}")
    result = table(rows, args)
    console.print(result)
    if args.write_docs:
        write_region(REPO / "docs" / "performance.md", "core-sharing", markdown(result), stamp)


if __name__ == "__main__":
    main()
