"""The profiler's per-layer times against one whole pass: how much the layer-by-layer split adds.

    python benchmarks/backward_split.py [--models cnn,hf_resnet] [--batch 32] [--passes 9] [--write-docs]

The profiler (:class:`deeppool.planner.profiling.passes.Passes`) times every layer in context: all forwards in
order, then every layer's backward as its own ``torch.autograd.backward`` call on detached leaves, so each
layer's time is its own. An executor stage runs the same layers' forwards, then *one* backward over the
stage. This benchmark runs both on the same model in one process, one intra-op thread (as a rank of a
2-rank run on this machine), alternating pass by pass: the per-layer sums (forward, backward) against
the whole pass's forward and its one backward (:meth:`Passes.whole`, the pass the profiler scales its layer times
to), medians over ``--passes`` each, at one per-GPU batch.
Models: the four the cost model's own fidelity benchmark uses (``benchmarks/models``) and the six
held-out ones of ``fidelity.py --zoo`` (``benchmarks/zoo``). "whole / per-layer" below 1 is what a
stage on one rank runs faster than the sum of its layers' profiled times. ``--write-docs`` puts the
table in docs/performance.md (region ``backward-split``).
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from deeppool.docregions import REPO, Stamp, markdown, write_region
from deeppool.model.layer_exec import runners
from deeppool.model.loading import load_model
from deeppool.model.trace import trace
from deeppool.plans import ModelSpec
from deeppool.planner.profiling.passes import Passes

HERE = Path(__file__).resolve().parent
MODELS = ("cnn", "branching_cnn", "transformer", "mlp", "hf_resnet", "hf_convnext", "hf_vit", "hf_bert",
          "vgg_small", "mobilenet_small")


@dataclass(frozen=True, kw_only=True)
class Split:
    """One model's medians (ms): per-layer sums and the whole pass, forward and backward."""

    name: str
    layers: int
    layer_fwd: float
    layer_bwd: float
    whole_fwd: float
    whole_bwd: float

    @property
    def bwd_ratio(self) -> float:
        return self.whole_bwd / self.layer_bwd

    @property
    def ratio(self) -> float:
        return (self.whole_fwd + self.whole_bwd) / (self.layer_fwd + self.layer_bwd)


def _path(name: str) -> Path:
    own = HERE / "models" / f"{name}.py"
    return own if own.is_file() else HERE / "zoo" / f"{name}.py"


def measure(name: str, batch: int, passes: int) -> Split:
    loaded = load_model(ModelSpec.parse(str(_path(name))))
    traced = trace(loaded)
    graph = traced.graph
    run = runners(traced.module, graph.layers)
    split = Passes(module=traced.module, graph=graph, runners=run, device=torch.device("cpu"))
    named = loaded.named_inputs(batch)
    inputs = {n: named[key] for n, key in zip(graph.inputs, graph.input_keys, strict=True)}
    for _ in range(2):
        split.run(inputs, batch=batch)
        split.whole(inputs, batch=batch)
    layered, whole = [], []
    for _ in range(passes):
        fwd, bwd, _ = split.run(inputs, batch=batch)
        layered.append((sum(fwd.values()), sum(bwd.values())))
        whole.append(split.whole(inputs, batch=batch))
    return Split(name=name, layers=len(graph.layers),
                 layer_fwd=statistics.median(f for f, _ in layered), layer_bwd=statistics.median(b for _, b in layered),
                 whole_fwd=statistics.median(f for f, _ in whole), whole_bwd=statistics.median(b for _, b in whole))


def table(splits: list[Split], batch: int) -> Table:
    shown = Table(title=f"per-layer profile vs one whole pass, batch {batch}, 1 thread (ms, medians)")
    for column in ("model", "layers", "per-layer fwd", "per-layer bwd", "whole fwd", "whole bwd",
                   "bwd whole / per-layer", "whole / per-layer"):
        shown.add_column(column, justify="left" if column == "model" else "right")
    for s in splits:
        shown.add_row(s.name, str(s.layers), f"{s.layer_fwd:.2f}", f"{s.layer_bwd:.2f}", f"{s.whole_fwd:.2f}",
                      f"{s.whole_bwd:.2f}", f"{s.bwd_ratio:.3f}", f"{s.ratio:.3f}")
    return shown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--passes", type=int, default=9)
    parser.add_argument("--write-docs", action="store_true", help="put the table in docs/performance.md")
    args = parser.parse_args()
    names = args.models.split(",")
    unknown = [n for n in names if not _path(n).is_file()]
    if unknown or args.batch < 2 or args.passes < 1:
        raise SystemExit(f"error: give --models from {','.join(MODELS)}, --batch >= 2 and --passes >= 1"
                         + (f" (no model '{unknown[0]}')" if unknown else ""))
    torch.set_num_threads(1)
    stamp = Stamp.started()
    splits = []
    with Progress(transient=True) as progress:
        task = progress.add_task("measuring", total=len(names))
        for name in names:
            splits.append(measure(name, args.batch, args.passes))
            progress.advance(task)
    shown = table(splits, args.batch)
    Console(width=160).print(shown)
    load = os.getloadavg()
    summary = (f"median whole / per-layer {statistics.median(s.ratio for s in splits):.3f} (backward alone "
               f"{statistics.median(s.bwd_ratio for s in splits):.3f}); load average {stamp.load_start:.2f} at the "
               f"start, {load[0]:.2f} at the end on {os.cpu_count()} cores")
    print(summary)
    if args.write_docs:
        write_region(REPO / "docs" / "performance.md", "backward-split", f"{markdown(shown)}\n\n{summary}\n", stamp)


if __name__ == "__main__":
    main()
