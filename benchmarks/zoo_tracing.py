"""Tracing and planning time of the test zoo's models with a device model, and where it goes.

    python benchmarks/zoo_tracing.py [--models hf_llama,tv_resnet] [--profile hf_bart]

For every model file under ``tests/models/zoo/``: the seconds to build and trace it as
``deeppool plan --device-model a100`` does (:func:`~deeppool.planner.trace.trace_spec`: the
meta device where torch.fx traces it, else CPU tensors and torch.export), then to plan it for
4 A100s at batch 8, its layer count and tracer, with the load average before and after (the
machine is shared: figures under load are upper bounds). A tiny model is traced first, so the
one-time cost of torch's dispatch machinery is not charged to the first model. ``--profile``
prints cProfile's functions with the most cumulative time for one model's trace: where the
time goes. The target: tracing and planning a model of under 100 layers in at most 5 s.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time
from pathlib import Path

from deeppool.planner.api import PlanRequest, device_setup, plan_graph
from deeppool.planner.modelspec import ModelSpec
from deeppool.planner.trace import trace_spec

ZOO = Path(__file__).resolve().parents[1] / "tests" / "models" / "zoo"
TARGET_S = 5.0


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def _plan_seconds(spec: ModelSpec) -> tuple[float, float, int, str]:
    start = time.perf_counter()
    _, traced = trace_spec(spec, meta=True)
    traced_at = time.perf_counter()
    request = PlanRequest(gpus=4, global_batch=8)
    profile, network = device_setup("a100", request.global_batch, request.gpus, traced.graph)
    plan_graph(traced.graph, profile, network, request, model=spec)
    return traced_at - start, time.perf_counter() - traced_at, len(traced.graph), traced.graph.method.value


def _profile(name: str) -> None:
    spec = ModelSpec.parse(str(ZOO / f"{name}.py"))
    profiler = cProfile.Profile()
    profiler.enable()
    trace_spec(spec, meta=True)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(40)
    print(out.getvalue())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(sorted(p.stem for p in ZOO.glob("*.py") if p.stem != "__init__")))
    parser.add_argument("--profile", default="", help="print where one model's trace spends its time")
    args = parser.parse_args()
    _plan_seconds(ModelSpec.parse(str(ZOO / "attn_shapes.py")))  # torch's one-time dispatch set-up
    print(f"load average before: {_load()}")
    print(f"{'model':14} {'layers':>6} {'tracer':>6} {'trace s':>8} {'plan s':>7} {'total s':>8}  within {TARGET_S:.0f} s")
    for name in args.models.split(","):
        trace_s, plan_s, layers, method = _plan_seconds(ModelSpec.parse(str(ZOO / f"{name}.py")))
        total = trace_s + plan_s
        print(f"{name:14} {layers:6d} {method:>6} {trace_s:8.2f} {plan_s:7.2f} {total:8.2f}  {total <= TARGET_S}")
    print(f"load average after: {_load()}")
    if args.profile:
        _profile(args.profile)


if __name__ == "__main__":
    main()
