"""Planner benchmark: plan time and plan quality, ILP vs its baselines, in one run.

    python benchmarks/planner.py [--gpus 8,32,256,1024] [--chains 50,100,200,500,1000]

For every example at every GPU count: tracing time (once per model, built on
the meta device as `deeppool plan --device-model` does, after a warm-up trace
of a tiny model that pays torch's one-time import of its dispatch machinery,
~1.5 s per process), ILP solve time and status,
predicted speedup over the best data-parallel width (and over data parallel
on all GPUs), and DeepPool's planner's time and plan quality (its predicted iteration time over the ILP's) measured in the
same run. Where the default candidate thinning (--max-candidates 32) drops
counts, the lossless ILP over every useful count is solved too and the
quality ratio reported. Then synthetic chains of 50 to 1000 layers. Layer
times come from the A100 device model, so profiling is excluded as the
issue asks. Targets: ResNet-50 at 256 GPUs planned in <= 2 s, the
GPT-2-style example (>= 300 layers) in <= 10 s, both with optimal status.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from deeppool.docregions import REPO, Stamp, markdown, write_region
from deeppool.model.graph import Layer, LayerGraph, TraceMethod
from deeppool.model.loading import LoadedModel, default_loss, load_model
from deeppool.model.trace import trace
from deeppool.plans import ModelSpec
from deeppool.planner.api import PlanRequest, device_setup, plan_graph
from deeppool.planner.hardware import NETWORKS, KnownDevice
from deeppool.planner.profiling.profile import LayerTimes, Profile
from deeppool.planner.request import DEFAULT_MAX_CANDIDATES
from deeppool.planner.solve import baselines
from deeppool.planner.solve.candidates import useful_counts
from deeppool.planner.solve.cost import CostModel

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MODELS = ("vgg16", "resnet50", "inception", "gpt2")
PERFORMANCE_DOC = REPO / "docs" / "performance.md"
REGION = "planner"
TARGETS = {("resnet50", 256): 2.0, ("gpt2", 32): 10.0}


@dataclass(frozen=True)
class Row:
    model: str
    layers: int
    gpus: int
    batch: int
    trace_s: float
    solve_s: float
    status: str
    speedup_vs_dp: float
    speedup_vs_best_dp: float
    deeppool_s: float
    deeppool_over_ilp: float
    candidates: int
    thinned_over_full: float | None = None


def _timed(work):
    began = time.perf_counter()
    result = work()
    return result, time.perf_counter() - began


def bench_example(name: str, gpu_counts: list[int]) -> list[Row]:
    spec = ModelSpec.parse(str(EXAMPLES / f"{name}.py"))
    traced, trace_s = _timed(lambda: trace(load_model(spec, meta=True)))
    rows = []
    for gpus in gpu_counts:
        batch = max(256, gpus)
        profile, network = device_setup("a100", batch, gpus, traced.graph)
        request = PlanRequest(gpus=gpus, global_batch=batch, time_limit_s=120)
        planned, solve_s = _timed(lambda: plan_graph(traced.graph, profile, network, request, model=spec))
        cost = planned.cost
        _, deeppool_s = _timed(lambda: baselines.deeppool(cost, gpus, None))
        predicted = planned.plan.predicted
        useful = len(useful_counts(gpus, batch))
        ratio = None
        if useful > DEFAULT_MAX_CANDIDATES:
            full = PlanRequest(gpus=gpus, global_batch=batch, time_limit_s=300, max_candidates=None)
            lossless = plan_graph(traced.graph, profile, network, full, model=spec).plan.predicted
            ratio = predicted.iteration_ms / lossless.iteration_ms
        rows.append(Row(name, len(traced.graph), gpus, batch, trace_s, solve_s, planned.plan.solver.status,
                        predicted.speedup_vs_data_parallel, predicted.speedup_vs_best_data_parallel, deeppool_s,
                        predicted.deeppool_iteration_ms / predicted.iteration_ms,
                        min(useful, DEFAULT_MAX_CANDIDATES), ratio))
    return rows


def synthetic_chain(length: int, seed: int) -> tuple[LayerGraph, Profile]:
    """A chain whose layers scale differently: some compute-bound, some latency-bound."""
    rng = random.Random(seed)
    layers, previous = [], "x"
    for index in range(length):
        name = f"l{index}"
        act = rng.choice([4_000, 40_000, 400_000])
        layers.append(Layer(name=name, op="Linear", target=name, nodes=(name,), inputs=(previous,),
                            output_shape=(act // 4,), dtype="float32", params=(f"{name}.w",),
                            param_bytes=rng.choice([0, 40_000, 4_000_000, 40_000_000]), act_bytes=act,
                            fwd_flops=1e6, bwd_flops=2e6))
        previous = name
    graph = LayerGraph(layers=tuple(layers), inputs=("x",), input_shapes=((8,),), output=previous,
                       method=TraceMethod.FX)
    batches = tuple(range(1, 257))
    times = {}
    for layer in layers:
        fixed, per_sample = rng.uniform(0.01, 0.1), rng.choice([0.0005, 0.005, 0.05])
        fwd = tuple(fixed + per_sample * b for b in batches)
        times[layer.name] = LayerTimes(batches=batches, fwd_ms=fwd, bwd_ms=tuple(2 * t for t in fwd))
    return graph, Profile(device="synthetic", source="benchmark", dtype="float32", memory_bytes=80 * 1024**3,
                          layers=times)


def bench_chain(length: int, gpus: int = 64, batch: int = 256) -> Row:
    graph, profile = synthetic_chain(length, seed=length)
    network = NETWORKS[KnownDevice.A100]
    request = PlanRequest(gpus=gpus, global_batch=batch, time_limit_s=300)
    spec = ModelSpec.parse(str(EXAMPLES / "vgg16.py"))
    planned, solve_s = _timed(lambda: plan_graph(graph, profile, network, request, model=spec))
    cost = CostModel(graph=graph, profile=profile, network=network, global_batch=batch)
    _, deeppool_s = _timed(lambda: baselines.deeppool(cost, gpus, None))
    predicted = planned.plan.predicted
    return Row(f"chain-{length}", length, gpus, batch, 0.0, solve_s, planned.plan.solver.status,
               predicted.speedup_vs_data_parallel, predicted.speedup_vs_best_data_parallel, deeppool_s,
               predicted.deeppool_iteration_ms / predicted.iteration_ms,
               min(len(useful_counts(gpus, batch)), DEFAULT_MAX_CANDIDATES))


def render(rows: list[Row]) -> Table:
    table = Table(title="planner: plan time and quality (A100 device model; profiling excluded)")
    for column in ("model", "layers", "GPUs", "batch", "counts", "trace s", "ILP solve s", "plan s", "status",
                   "vs data parallel, all GPUs", "vs best data parallel", "DeepPool planner s",
                   "DeepPool iter / ILP iter", "thinned / full", "target"):
        table.add_column(column, justify="right")
    for row in rows:
        target = TARGETS.get((row.model, row.gpus))
        total = row.trace_s + row.solve_s
        verdict = "" if target is None else f"<= {target:g} s: {'met' if total <= target else 'MISSED'}"
        quality = "lossless" if row.thinned_over_full is None else f"{row.thinned_over_full:.4f}"
        table.add_row(row.model, str(row.layers), str(row.gpus), str(row.batch), str(row.candidates),
                      f"{row.trace_s:.2f}", f"{row.solve_s:.2f}", f"{total:.2f}", row.status,
                      f"{row.speedup_vs_dp:.2f}x", f"{row.speedup_vs_best_dp:.2f}x", f"{row.deeppool_s:.3f}", f"{row.deeppool_over_ilp:.3f}",
                      quality, verdict)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="8,32,256,1024")
    parser.add_argument("--chains", default="50,100,200,500,1000")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--write-docs", action="store_true",
                        help=f"also write the table into {PERFORMANCE_DOC.relative_to(REPO)} (region '{REGION}')")
    args = parser.parse_args()
    stamp = Stamp.started()
    gpu_counts = [int(g) for g in args.gpus.split(",")]
    console = Console(width=220)
    warm_up = LoadedModel(torch.nn.Linear(4, 4), lambda b: (torch.randn(b, 4),), lambda b: None, default_loss)
    trace(warm_up)
    rows = []
    for name in args.models.split(","):
        rows += bench_example(name, gpu_counts)
        console.print(f"{name}: done")
    for length in (int(n) for n in args.chains.split(",") if n):
        rows.append(bench_chain(length))
        console.print(f"chain-{length}: done")
    table = render(rows)
    console.print(table)
    if args.write_docs:
        write_region(PERFORMANCE_DOC, REGION, markdown(table), stamp)
        console.print(f"wrote region '{REGION}' of {PERFORMANCE_DOC}")


if __name__ == "__main__":
    main()
