"""Tracing and planning time of the test zoo's models with a device model, and where it goes.

    python benchmarks/zoo_tracing.py [--models hf_llama,tv_resnet] [--profile hf_bart] [--write-docs]

For every model file under ``tests/models/zoo/``: the seconds to build and trace it as
``deeppool plan --device-model a100`` does (:func:`~deeppool.model.trace.trace_spec`: the
meta device where torch.fx traces it, else CPU tensors and torch.export), then to plan it for
4 A100s at batch 8, its layer count and tracer, with the load average before and after (the
machine is shared: figures under load are upper bounds). Where the trace's time goes comes from
a second, profiled trace of the same model (cProfile's cumulative time, as shares of that run):
building the model (``model()``; the meta attempt included), torch.fx, torch.export, and probing
the graph (shapes and FLOPs on meta or fake tensors at batches 2 and 3, layers grouped).
A tiny model is traced first and ``transformers`` imported before the timings, so one-time
costs (torch's dispatch machinery, the import, printed on its own line) are not charged to the
first model. "CPU s" is the process's CPU time for the trace and the plan, which a busy machine
inflates far less than the wall time. ``--profile`` prints cProfile's functions with the most cumulative time for one
model's trace. The target: tracing and planning a model of under 100 layers in at most 5 s.
``--write-docs`` also writes the table into docs/performance.md (region 'zoo-tracing').
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from deeppool.docregions import REPO, Stamp, markdown, write_region
from deeppool.model.trace import trace_spec
from deeppool.plans import ModelSpec
from deeppool.planner.api import PlanRequest, device_setup, plan_graph

ZOO = REPO / "tests" / "models" / "zoo"
TARGET_S = 5.0
PHASES: dict[str, tuple[str, ...]] = {
    "build": ("modelspec.py", "load"),
    "fx": ("trace.py", "_fx_trace"),
    "export": ("trace.py", "_export"),
    "probe": ("trace.py", "_graph_of"),
}
"""A phase of the trace: the (file name, function) whose cumulative time it is."""


@dataclass(frozen=True, kw_only=True)
class Timing:
    """One model's seconds and the shares of its trace's time by phase."""

    name: str
    layers: int
    method: str
    trace_s: float
    plan_s: float
    cpu_s: float
    """This process's CPU time for the trace and the plan: what the wall time would be on an idle machine
    (they run on one thread), so a busy machine's figures can still be read."""
    shares: dict[str, float]

    @property
    def total_s(self) -> float:
        return self.trace_s + self.plan_s


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def _shares(spec: ModelSpec) -> dict[str, float]:
    """Each phase's share of a profiled trace of ``spec`` (cumulative time over the whole trace's)."""
    profiler = cProfile.Profile()
    profiler.enable()
    trace_spec(spec, meta=True)
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    cumulative: dict[str, float] = dict.fromkeys(PHASES, 0.0)
    whole = 0.0
    for (filename, _, function), (_, _, _, cum, _) in stats.items():
        if Path(filename).name == "trace.py" and function == "trace_spec":
            whole = cum
        for phase, (file, name) in PHASES.items():
            if Path(filename).name == file and function == name:
                cumulative[phase] += cum
    return {phase: cum / whole if whole else 0.0 for phase, cum in cumulative.items()}


def _timing(name: str) -> Timing:
    spec = ModelSpec.parse(str(ZOO / f"{name}.py"))
    start, cpu = time.perf_counter(), time.process_time()
    _, traced = trace_spec(spec, meta=True)
    traced_at = time.perf_counter()
    request = PlanRequest(gpus=4, global_batch=8)
    profile, network = device_setup("a100", request.global_batch, request.gpus, traced.graph)
    plan_graph(traced.graph, profile, network, request, model=spec)
    return Timing(name=name, layers=len(traced.graph), method=traced.graph.method.value,
                  trace_s=traced_at - start, plan_s=time.perf_counter() - traced_at,
                  cpu_s=time.process_time() - cpu, shares=_shares(spec))


def _profile(name: str) -> None:
    spec = ModelSpec.parse(str(ZOO / f"{name}.py"))
    profiler = cProfile.Profile()
    profiler.enable()
    trace_spec(spec, meta=True)
    profiler.disable()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(40)
    print(out.getvalue())


def _table(timings: list[Timing]) -> Table:
    table = Table(title=f"Tracing and planning with a device model (a100, 4 GPUs, batch 8); target {TARGET_S:.0f} s")
    for column in ("model", "layers", "tracer", "trace s", "plan s", "total s", "CPU s", f"within {TARGET_S:.0f} s",
                   *(f"{phase} %" for phase in PHASES)):
        table.add_column(column, justify="left" if column in ("model", "tracer") else "right")
    for t in timings:
        table.add_row(t.name, str(t.layers), t.method, f"{t.trace_s:.2f}", f"{t.plan_s:.2f}", f"{t.total_s:.2f}", f"{t.cpu_s:.2f}",
                      "yes" if t.total_s <= TARGET_S else "no", *(f"{100 * t.shares[p]:.0f}" for p in PHASES))
    return table


def _import_seconds() -> float:
    start = time.perf_counter()
    import transformers  # noqa: F401  the zoo's HF models import it: a one-time cost, timed apart

    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(sorted(p.stem for p in ZOO.glob("*.py") if p.stem != "__init__")))
    parser.add_argument("--profile", default="", help="print where one model's trace spends its time")
    parser.add_argument("--write-docs", action="store_true",
                        help="also write the table into docs/performance.md (region 'zoo-tracing')")
    args = parser.parse_args()
    stamp = Stamp.started()
    trace_spec(ModelSpec.parse(str(ZOO / "attn_shapes.py")), meta=True)  # torch's one-time dispatch set-up
    imported = _import_seconds()
    before = _load()
    console = Console(width=200)
    timings: list[Timing] = []
    for name in args.models.split(","):
        timings.append(_timing(name))
        console.print(f"{name}: {timings[-1].total_s:.2f} s (CPU {timings[-1].cpu_s:.2f} s), load {_load()}")
    console.print(_table(timings))
    note = (f"One-time, not in the table: `import transformers` {imported:.2f} s. Phases are shares of a second, "
            "profiled trace: build (`model()`, the meta attempt included), fx, export, probe (shapes and FLOPs at "
            f"batches 2 and 3, layers grouped); the rest is glue. Load average before {before}, after {_load()}.")
    console.print(note)
    if args.write_docs:
        write_region(REPO / "docs" / "performance.md", "zoo-tracing", f"{markdown(_table(timings))}\n\n{note}",
                     stamp)
    if args.profile:
        _profile(args.profile)


if __name__ == "__main__":
    main()
