"""Plans for the multiplexing tests: a 2-rank burst plan whose middle layer runs on rank 0 alone."""

from __future__ import annotations

from pathlib import Path

from deeppool.model.loading import load_model
from deeppool.model.trace import trace
from deeppool.plans import ModelSpec, Plan, SolverInfo, Strategy
from deeppool.planner.hardware import DEVICES, NETWORKS, KnownDevice
from deeppool.planner.profiling.profile import estimated_profile
from deeppool.planner.solve.baselines import Baselines
from deeppool.planner.solve.build import build_plan
from deeppool.planner.solve.cost import CostModel

MODELS = Path(__file__).resolve().parent / "models"
REPO = Path(__file__).resolve().parents[2]
BACKGROUND = REPO / "examples" / "background_mlp.py"


def burst_plan(*, global_batch: int = 64, lone: tuple[int, ...] = (2, 3), gpus: int = 2, path: Path | None = None) -> Plan:
    """``burst_fg.py`` on ``gpus`` ranks; layers ``lone`` on one GPU (rank 1 idle there), the rest on all."""
    spec = ModelSpec.parse(str(path or MODELS / "burst_fg.py"))
    graph = trace(load_model(spec)).graph
    profile = estimated_profile(graph, DEVICES[KnownDevice.A100], (1, 2, 4, 8, 16, 32, 64, 128))
    cost = CostModel(graph=graph, profile=profile, network=NETWORKS[KnownDevice.A100], global_batch=global_batch)
    assignment = {layer.name: 1 if i in lone else gpus for i, layer in enumerate(graph.layers)}
    return build_plan(
        cost, assignment, model=spec, gpus=gpus, strategy=Strategy.ILP, amplification_limit=None,
        solver=SolverInfo(name="hand", status="Optimal", seconds=0.0, gap=0.0),
        baselines=Baselines(data_parallel_ms=1.0, deeppool_ms=1.0, best_data_parallel_gpus=1, best_data_parallel_ms=1.0),
    )
