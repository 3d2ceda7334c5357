"""Library-mode overhead: a user loop over ``deeppool.parallelize`` against ``deeppool run``, same plan.

    python benchmarks/library.py [--steps 30] [--warmup 5] [--repeats 4] [--launches 5] [--batch 32] [--write-docs]

Both run a burst plan of ``benchmarks/models/cnn.py`` (the conv blocks on 2 ranks, the head on 1:
two distinct GPU counts) with SGD (lr 0.01) on the model's synthetic batch, in the same 2 gloo
ranks (one thread each) started by ``deeppool run --script``, so both see the same machine: each
repeat runs ``--steps`` iterations of what a ``deeppool run`` rank runs (``train_rank``), then
``--steps`` of the user loop (``bp.step`` + ``opt.step()`` + ``opt.zero_grad()``). Both are timed as
whole loop bodies, wall clock, median after ``--warmup``: ``deeppool run``'s from one iteration's start
to the next (its iteration span, optimizer step included, plus what its loop does between iterations:
the step monitor's all-gather of times and losses every 10 steps, the progress file), the user loop's
around its three calls (``bp.step`` returns the global loss, its all-reduce launched every step). The
span alone is shown beside. Each figure is the slowest rank's median. The ranks are started
``--launches`` times, and within a start the two loops alternate which runs first: one start's own
memory layout moves both loops by several percent, so a single start cannot tell 3%. The table shows
every repeat, each launch's median ratio, the median ratio over all of them (target: at most 1.03) and
the load average before and after, since the machine may be shared. The two loops run one after the
other, so on a loaded machine their ratio wanders; the loop's time over its own engine span
(``bp.last_step_s``, the same engine code ``deeppool run`` times) is measured on the same steps and
bounds what the library layer adds (with the user's ``opt.step()``, which ``deeppool run``'s span
includes too). ``--write-docs`` puts the printed report in ``docs/performance.md`` (region ``library``).

This file is also the user's training script (``worker`` mode, run by ``deeppool run --script``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from deeppool.docregions import REPO, Stamp, teed_stdout, text_block, write_region
from deeppool.model.loading import load_model

HERE = Path(__file__).resolve().parent
MODEL = HERE / "models" / "cnn.py"
LR = 0.01


def burst_plan(path: Path, batch: int) -> None:
    """The CNN's conv blocks on 2 GPUs, its pooling and head on 1 (an estimated A100 profile)."""
    from deeppool.model.trace import trace
    from deeppool.plans import ModelSpec, SolverInfo, Strategy
    from deeppool.planner.hardware import DEVICES, NETWORKS, KnownDevice
    from deeppool.planner.profiling.profile import estimated_profile
    from deeppool.planner.solve.baselines import Baselines, tie
    from deeppool.planner.solve.build import build_plan
    from deeppool.planner.solve.cost import CostModel

    spec = ModelSpec.parse(str(MODEL))
    graph = trace(load_model(spec)).graph
    profile = estimated_profile(graph, DEVICES[KnownDevice.A100], (1, 2, 4, 8, 16, 32, 64))
    cost = CostModel(graph=graph, profile=profile, network=NETWORKS[KnownDevice.A100], global_batch=batch)
    blocks = {layer.name for layer in graph.layers if layer.name.count("_") == 2}  # "_<block>_<index>"
    assignment = tie(cost, {layer.name: 2 if layer.name in blocks else 1 for layer in graph.layers})
    plan = build_plan(cost, assignment, model=spec, gpus=2, strategy=Strategy.ILP, amplification_limit=None,
                      solver=SolverInfo(name="hand", status="Optimal", seconds=0.0, gap=0.0),
                      baselines=Baselines(data_parallel_ms=1.0, deeppool_ms=1.0, best_data_parallel_gpus=1,
                                          best_data_parallel_ms=1.0))
    assert len({layer.gpus for layer in plan.layers}) == 2, "the plan must be a burst plan"
    plan.save(path)


def worker(steps: int, warmup: int, repeats: int, out: Path) -> None:
    """On every rank, ``repeats`` times: ``steps`` iterations of ``deeppool run``'s rank (``train_rank``),
    then ``steps`` of the user loop over ``parallelize``; rank 0 writes the slowest rank's medians (ms)."""
    import importlib.util

    import torch
    import torch.distributed as dist

    import deeppool
    from deeppool.executor.api import train_rank
    from deeppool.executor.config import OptimizerConfig, RunConfig
    from deeppool.executor.engine.comm import TorchComm
    from deeppool.executor.engine.program import rank_groups
    from deeppool.executor.engine.timing import Category
    from deeppool.plans import Optimizer

    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("cnn", MODEL)
    assert spec is not None and spec.loader is not None
    model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(model)
    plan = deeppool.Plan.load(os.environ["DEEPPOOL_PLAN"])
    torch.manual_seed(plan.model.seed)
    bp = deeppool.parallelize(model.model(), plan)
    opt = torch.optim.SGD(bp.parameters(), lr=LR)
    (x,), y = model.inputs(plan.global_batch), model.targets(plan.global_batch)
    comm = TorchComm(rank_groups(plan), timeout_s=300.0)
    config = RunConfig(steps=steps, warmup=warmup, optimizer=OptimizerConfig(kind=Optimizer.SGD, lr=LR))
    def user_loop() -> tuple[float, float]:
        times, spans = [], []
        for _ in range(steps):
            start = time.perf_counter()
            bp.step(x, y, model.loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
            spans.append(bp.last_step_s)
        return statistics.median(times[warmup:]) * 1e3, statistics.median(spans[warmup:]) * 1e3

    def run_loop() -> tuple[float, float]:
        """``deeppool run``'s rank: median ms from one iteration's start to the next, and of the span."""
        result = train_rank(plan, comm=comm, config=config)
        starts = sorted((s.step, s.start_s) for s in result.spans if s.category is Category.ITERATION)
        gaps = [(b - a) * 1e3 for (step, a), (_, b) in zip(starts, starts[1:], strict=False) if step >= warmup]
        return statistics.median(gaps), result.times.iteration_ms

    pairs = []
    for repeat in range(repeats):
        if repeat % 2:  # odd repeats run the user loop first: neither side always runs on a warmer process
            library, engine = user_loop()
            executor, span = run_loop()
        else:
            executor, span = run_loop()
            library, engine = user_loop()
        gathered: list[tuple[float, ...]] = [(0.0,) * 4] * dist.get_world_size()
        dist.all_gather_object(gathered, (executor, library, engine, span))
        pairs.append(tuple(max(g[i] for g in gathered) for i in range(4)))
    if bp.is_logging_rank:
        out.write_text(json.dumps({"pairs": pairs}))


def measure(plan: Path, work: Path, steps: int, warmup: int, repeats: int) -> list[tuple[float, ...]]:
    """The ranks, started by ``deeppool run --script``: (``deeppool run`` ms, ``parallelize`` ms, its
    engine span ms, ``deeppool run``'s iteration span ms) per repeat."""
    work.mkdir(parents=True, exist_ok=True)
    result = work / "pairs.json"
    args = ["worker", str(steps), str(warmup), str(repeats), str(result)]
    done = subprocess.run([sys.executable, "-m", "deeppool.cli", "run", "--script", __file__, str(plan),
                           "--out", str(work / "run"), *[f"--script-arg={a}" for a in args]],
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: the benchmark's ranks failed: {done.stderr.strip()[-2000:]}")
    return [tuple(pair) for pair in json.loads(result.read_text())["pairs"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=4, help="alternations of the two loops in each launch")
    parser.add_argument("--launches", type=int, default=5,
                        help="separate starts of the ranks (a process's own layout moves both loops' times)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--write-docs", action="store_true",
                        help="put the report in docs/performance.md (region 'library')")
    args = parser.parse_args()
    if args.steps <= args.warmup or args.repeats < 1 or args.launches < 1 or args.batch < 2:
        raise SystemExit("error: give --steps > --warmup >= 0, --repeats >= 1, --launches >= 1 and --batch >= 2")
    stamp = Stamp.started()
    with teed_stdout() as printed:
        report(args.steps, args.warmup, args.repeats, args.batch, args.launches)
    if args.write_docs:
        write_region(REPO / "docs" / "performance.md", "library", text_block(printed.getvalue()), stamp)


def report(steps: int, warmup: int, repeats: int, batch: int, launches: int) -> None:
    """Measure and print the table (the plan and the ranks' outputs in a temporary folder, removed after)."""
    with tempfile.TemporaryDirectory(prefix="deeppool-library-bench-") as folder:
        work = Path(folder)
        plan = work / "plan.json"
        burst_plan(plan, batch)
        load_before = os.getloadavg()
        launched = [measure(plan, work / f"launch{index}", steps, warmup, repeats) for index in range(launches)]
        load_after = os.getloadavg()
    print(f"burst plan of {MODEL.name} (batch {batch}, 2 gloo ranks), {steps} steps, "
          f"median after {warmup}; slowest rank; {launches} launches of the ranks, {repeats} repeats each")
    print(f"{'launch':>6}  {'repeat':>6}  {'deeppool run ms':>15}  {'parallelize ms':>14}  {'ratio':>6}  "
          f"{'engine ms':>9}  {'loop/engine':>11}  {'run span ms':>11}")
    for launch, pairs in enumerate(launched):
        for index, (executor, library, engine, span) in enumerate(pairs):
            print(f"{launch:>6}  {index:>6}  {executor:>15.2f}  {library:>14.2f}  {library / executor:>6.3f}  "
                  f"{engine:>9.2f}  {library / engine:>11.3f}  {span:>11.2f}")
    medians = [statistics.median(pair[1] / pair[0] for pair in pairs) for pairs in launched]
    pairs = [pair for launch in launched for pair in launch]
    ratio = statistics.median(pair[1] / pair[0] for pair in pairs)
    outside = statistics.median(pair[1] / pair[2] for pair in pairs)
    spans = statistics.median(pair[1] / pair[3] for pair in pairs)
    print("median ratio of each launch: " + ", ".join(f"{m:.3f}" for m in medians))
    print(f"median ratio parallelize / deeppool run, every repeat of every launch: {ratio:.3f} (target <= 1.03)")
    print(f"median ratio parallelize / deeppool run's iteration span alone (without its loop's own work): {spans:.3f}")
    print(f"median ratio of the loop to its engine span (what the library and the user's optimizer add, "
          f"measured on the same steps): {outside:.3f}")
    print("load average (1, 5, 15 min): before " + " ".join(f"{v:.2f}" for v in load_before)
          + ", after " + " ".join(f"{v:.2f}" for v in load_after) + f" on {os.cpu_count()} cores")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
    else:
        main()
