"""Which reading of the host's speed follows a model's step: the profiler's reference work, or memory traffic.

    python benchmarks/host_speed.py [--model hf_bert] [--batch 16] [--minutes 15] [--write-docs]

The local profiler reads a fixed piece of work (:func:`deeppool.planner.profiling.timing.reference_ms`: 256×256
matmuls and many small ops, all in the cache) before and after each batch it measures, and measures a
cached batch again when that reading has moved. On this VM a plan was once measured 1.5x slow while the
reference read as usual (``docs/performance.md``, the held-out sets), so this asks which reading follows
the model's own step. One process on one intra-op thread takes samples for ``--minutes``, pinned to one
core after the other: the reference, a memory-bound reading (a copy of 64 MiB, far beyond the caches) and
the median of 3 forward+backward steps of a held-out model of ``benchmarks/zoo`` at ``--batch`` samples.

What a plan needs from a reading is to carry a step measured at one time to another: for pairs of samples
at least a minute apart, the table gives the share whose later step is within ±15% of the earlier one
scaled by the reading's ratio, against the earlier step unscaled (the baseline, the same pairs). Also the
correlation of each reading's log-ratio to its median with the step's, and each core's median and slow
samples (a step above 1.15x the median). The time series is drawn to ``docs/images/host-speed.png``.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from deeppool.docregions import REPO, Stamp, markdown, write_region
from deeppool.model.loading import load_model
from deeppool.plans import ModelSpec
from deeppool.planner.profiling.timing import reference_ms

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ZOO = Path(__file__).resolve().parent / "zoo"
PLOT = REPO / "docs" / "images" / "host-speed.png"
BOUND = 0.15
"""The fidelity goal's ±15%."""
APART_S = 60.0
"""Pairs of samples at least this far apart: a plan's measurement and its run."""
PAIRS = 20_000


@dataclass(frozen=True, kw_only=True)
class Sample:
    at_s: float
    core: int
    reference_ms: float
    memory_ms: float
    step_ms: float


def memory_ms(repeats: int = 3, mebibytes: int = 64) -> float:
    """The median ms of copying ``mebibytes`` between two tensors on the calling thread (memory-bound)."""
    source = torch.ones(mebibytes * 2**18)
    target = torch.empty_like(source)
    target.copy_(source)
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - began)
    return 1e3 * statistics.median(times)


def model_step(model: str, batch: int) -> Callable[[], float]:
    loaded = load_model(ModelSpec.parse(str(ZOO / f"{model}.py")))
    module, inputs, targets = loaded.module, loaded.named_inputs(batch), loaded.targets(batch)

    def step() -> float:
        began = time.perf_counter()
        loaded.loss(module(**inputs), targets).backward()
        return 1e3 * (time.perf_counter() - began)

    for _ in range(3):
        step()
    return step


def sample(began: float, core: int, step: Callable[[], float]) -> Sample:
    os.sched_setaffinity(0, {core})
    step()  # settles on the core
    return Sample(at_s=time.perf_counter() - began, core=core, reference_ms=reference_ms(), memory_ms=memory_ms(),
                  step_ms=statistics.median(step() for _ in range(3)))


def collect(args: argparse.Namespace) -> list[Sample]:
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    step = model_step(args.model, args.batch)
    samples: list[Sample] = []
    began = time.perf_counter()
    with Progress(transient=True) as progress:
        task = progress.add_task(f"{args.model} at {args.batch} samples on cores {cores}", total=60 * args.minutes)
        while (elapsed := time.perf_counter() - began) < 60 * args.minutes:
            samples.append(sample(began, cores[len(samples) % len(cores)], step))
            progress.update(task, completed=elapsed)
    os.sched_setaffinity(0, set(cores))
    return samples


def ratios(values: list[float]) -> list[float]:
    middle = statistics.median(values)
    return [v / middle for v in values]


def correlation(xs: list[float], ys: list[float]) -> float:
    return statistics.correlation([math.log(x) for x in xs], [math.log(y) for y in ys])


def carried(samples: list[Sample], reading: Callable[[Sample], float] | None, apart_s: float = APART_S,
            seed: int = 0) -> float:
    """The share of pairs at least ``apart_s`` apart whose later step is within the bound of the earlier one
    scaled by ``reading``'s ratio (None: unscaled); NaN where no pair is that far apart."""
    rng, hits, pairs = random.Random(seed), 0, 0
    for _ in range(PAIRS):
        first, second = sorted(rng.sample(samples, 2), key=lambda s: s.at_s)
        if second.at_s - first.at_s < apart_s:
            continue
        scale = reading(second) / reading(first) if reading is not None else 1.0
        pairs += 1
        hits += abs(second.step_ms / (first.step_ms * scale) - 1) <= BOUND
    return hits / pairs if pairs else float("nan")


def table(samples: list[Sample], args: argparse.Namespace) -> Table:
    steps = ratios([s.step_ms for s in samples])
    out = Table(title=f"{args.model}, batch {args.batch}, one thread, {len(samples)} samples over {args.minutes} "
                      f"minutes, cores taken in turn",
                caption=f"'carried': pairs of samples at least {args.apart_s:g} s apart whose later step is within "
                        f"±{100 * BOUND:.0f}% of the earlier one times the reading's ratio; 'none' is the baseline "
                        f"(the earlier step as it was, the same pairs)")
    for header in ("reading", "median", "10th-90th percentile / median", "correlation with the step",
                   "carried within ±15%"):
        out.add_column(header)
    readings: list[tuple[str, Callable[[Sample], float] | None]] = [
        ("none (baseline)", None), ("reference work (ms)", lambda s: s.reference_ms),
        ("64 MiB copy (ms)", lambda s: s.memory_ms), ("the step itself (ms)", lambda s: s.step_ms)]
    for name, reading in readings:
        if reading is None:
            out.add_row(name, "-", "-", "-", f"{100 * carried(samples, None, args.apart_s):.0f}%")
            continue
        values = [reading(s) for s in samples]
        deciles = statistics.quantiles(ratios(values), n=10)
        out.add_row(name, f"{statistics.median(values):.2f}", f"{deciles[0]:.2f}-{deciles[-1]:.2f}",
                    f"{correlation(ratios(values), steps):.2f}", f"{100 * carried(samples, reading, args.apart_s):.0f}%")
    return out


def cores_table(samples: list[Sample]) -> Table:
    middle = statistics.median(s.step_ms for s in samples)
    out = Table(title="by core", caption=f"'slow': a step above {1 + BOUND:.2f}x the median of all samples")
    both = "slow while the other core's next sample was slow too"
    for header in ("core", "samples", "median step (ms)", "slow samples", both):
        out.add_column(header)
    for core in sorted({s.core for s in samples}):
        mine = [i for i, s in enumerate(samples) if s.core == core]
        slow = [i for i in mine if samples[i].step_ms > (1 + BOUND) * middle]
        together = sum(i + 1 < len(samples) and samples[i + 1].step_ms > (1 + BOUND) * middle for i in slow)
        out.add_row(str(core), str(len(mine)), f"{statistics.median(samples[i].step_ms for i in mine):.2f}",
                    str(len(slow)), str(together))
    return out


def plot(samples: list[Sample], path: Path) -> None:
    figure, axis = plt.subplots(figsize=(11, 4.5))
    series = (("step", [s.step_ms for s in samples], "black"), ("reference work", [s.reference_ms for s in samples],
              "tab:blue"), ("64 MiB copy", [s.memory_ms for s in samples], "tab:orange"))
    for core, marker in zip(sorted({s.core for s in samples}), ("o", "x"), strict=False):
        mine = [i for i, s in enumerate(samples) if s.core == core]
        for name, values, colour in series:
            scaled = ratios(values)
            axis.plot([samples[i].at_s / 60 for i in mine], [scaled[i] for i in mine], marker, ms=1.5, color=colour,
                      alpha=0.4, label=f"{name}, core {core}")
    axis.axhspan(1 - BOUND, 1 + BOUND, color="grey", alpha=0.12)
    axis.set_xlabel("minutes")
    axis.set_ylabel("time / its median")
    axis.set_ylim(0.6, 2.2)
    axis.legend(ncol=3, fontsize=7, loc="upper right")
    axis.set_title("the host's speed over time: a model's step and two readings of it")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="hf_bert", help="a held-out model of benchmarks/zoo")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--apart-s", type=float, default=APART_S, help="pairs at least this far apart (seconds)")
    parser.add_argument("--plot", type=Path, default=PLOT)
    parser.add_argument("--write-docs", action="store_true",
                        help="also write the tables into docs/performance.md (region 'host-speed')")
    args = parser.parse_args()
    if not (ZOO / f"{args.model}.py").is_file():
        parser.error(f"--model {args.model}: no such held-out model in benchmarks/zoo")
    if args.batch < 1 or args.minutes <= 0 or args.apart_s < 0:
        parser.error("--batch must be at least 1, --minutes above 0 and --apart-s at least 0")
    stamp = Stamp.started()
    samples = collect(args)
    if len(samples) < 4:
        parser.error(f"{len(samples)} samples in {args.minutes} minutes: too few to compare; take more minutes")
    console = Console(width=180)
    result, by_core = table(samples, args), cores_table(samples)
    console.print(result)
    console.print(by_core)
    plot(samples, args.plot)
    console.print(f"time series drawn to {args.plot}")
    if args.write_docs:
        body = markdown(result) + "\n\n" + markdown(by_core) + f"\n\n![host speed]({args.plot.relative_to(REPO / 'docs')})\n"
        write_region(REPO / "docs" / "performance.md", "host-speed", body, stamp)


if __name__ == "__main__":
    main()
