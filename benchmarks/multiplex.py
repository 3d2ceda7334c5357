"""Multiplexing benchmark: a 2-rank burst plan with a real idle window, and a real background job.

    python benchmarks/multiplex.py [--steps 60] [--batch 256] [--modes none,sched_idle,gate] [--out DIR] [--write-docs]

The foreground (this file is its model file) is a chain whose two middle
layers are planned on one GPU: rank 1 idles while rank 0 runs them, every
iteration. The background is ``examples/background_mlp.py``. Each mode runs
the plan once through ``deeppool multiplex bench`` (interleaved A/B blocks:
foreground alone vs shared, medians), and one table gives each mode's
foreground slowdown, recovered share of the idle rank-time and background
samples/s. Goal on CPU (``gate``): slowdown <= 10% while recovering >= 30%.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
WIDTH, CLASSES = 768, 10
LONE = (2, 3)  # layers on one GPU


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, CLASSES))


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, WIDTH, generator=torch.Generator().manual_seed(0)),)


def targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, CLASSES, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)


def burst_plan(batch: int):
    from deeppool.planner.baselines import Baselines
    from deeppool.planner.cost import CostModel
    from deeppool.planner.hardware import DEVICES, NETWORKS, KnownDevice
    from deeppool.planner.modelspec import ModelSpec
    from deeppool.planner.plan import SolverInfo, Strategy, build_plan
    from deeppool.planner.profile import estimated_profile
    from deeppool.planner.trace import trace

    spec = ModelSpec.parse(str(Path(__file__).resolve()))
    graph = trace(spec.load()).graph
    profile = estimated_profile(graph, DEVICES[KnownDevice.A100], (1, 2, 4, 8, 16, 32, 64, 128, 256, 512))
    cost = CostModel(graph=graph, profile=profile, network=NETWORKS[KnownDevice.A100], global_batch=batch)
    assignment = {layer.name: 1 if i in LONE else 2 for i, layer in enumerate(graph.layers)}
    return build_plan(cost, assignment, model=spec, gpus=2, strategy=Strategy.ILP, amplification_limit=None,
                      solver=SolverInfo(name="hand", status="Optimal", seconds=0.0, gap=0.0),
                      baselines=Baselines(data_parallel_ms=1.0, deeppool_ms=1.0, best_data_parallel_gpus=1, best_data_parallel_ms=1.0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--bg-batch", type=int, default=8)
    parser.add_argument("--modes", default="none,sched_idle,gate")
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--write-docs", action="store_true",
                        help="also write the table into docs/performance.md (region 'multiplex')")
    args = parser.parse_args()
    from deeppool.cli import app
    from deeppool.docregions import Stamp, teed_stdout, text_block, write_region

    stamp = Stamp.started()
    args.out = args.out or Path(tempfile.mkdtemp(prefix="deeppool-mux-bench-"))
    args.out.mkdir(parents=True, exist_ok=True)
    plan_path = args.out / "plan.json"
    burst_plan(args.batch).save(plan_path)
    with teed_stdout() as printed:
        app(["multiplex", "bench", str(plan_path), "--background", str(REPO / "examples" / "background_mlp.py"),
             "--out", str(args.out), "--modes", args.modes, "--steps", str(args.steps), "--bg-batch",
             str(args.bg_batch)], standalone_mode=False)
    if args.write_docs:
        report = [line for line in printed.getvalue().splitlines() if not line.startswith("wrote ")]
        write_region(REPO / "docs" / "performance.md", "multiplex", text_block("\n".join(report)), stamp)


if __name__ == "__main__":
    main()
