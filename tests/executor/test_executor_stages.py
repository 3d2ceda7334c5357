"""Stages: consecutive layers on one split run as one compiled module, one backward, exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deeppool.executor.config import OptimizerConfig, RunConfig
from deeppool.executor.engine.engine import Engine
from deeppool.executor.engine.overlap import StageOverlap
from deeppool.executor.engine.program import OpKind, Stage, build_program, partition
from deeppool.executor.engine.stage_module import StageModule
from deeppool.model.loading import load_model
from deeppool.model.trace import trace
from tests.executor.plans import Assign, cycle, make_plan, make_plan_for
from tests.executor.test_executor_exact import train_threads
from tests.executor.test_executor_processes import REPO, deeppool_run


def test_a_data_parallel_plan_is_one_stage_with_no_reshards() -> None:
    plan = make_plan("tiny_gpt", global_batch=4, gpus=2, assign=cycle(2))
    graph = trace(load_model(plan.model)).graph
    stages = partition(plan, graph)
    assert len(stages) == 1 and stages[0].layers == tuple(layer.name for layer in graph.layers)
    for rank in range(2):
        kinds = [op.kind for op in build_program(plan, graph, rank).ops]
        assert kinds == [OpKind.FORWARD, OpKind.LOSS, OpKind.BACKWARD, OpKind.ALLREDUCE, OpKind.STEP]


def test_stages_break_where_the_split_changes_or_a_producer_has_another_split() -> None:
    plan = make_plan("residual", global_batch=7, gpus=4, assign=cycle(1, 1, 4, 4, 4, 2, 2, 3))
    graph = trace(load_model(plan.model)).graph
    stages = partition(plan, graph)
    assert [name for stage in stages for name in stage.layers] == [layer.name for layer in graph.layers]
    planned = {layer.name: layer for layer in plan.layers}
    inputs = {layer.name: layer.inputs for layer in graph.layers}
    for stage in stages:
        assert {planned[name].gpus for name in stage.layers} == {stage.gpus}
        for name in stage.layers[1:]:  # only a stage's first layer reads from another split
            assert all(planned[src].gpus == stage.gpus for src in inputs[name] if src in planned)
    assert any(len(stage.layers) > 1 for stage in stages) and len(stages) < len(graph.layers)
    program = build_program(plan, graph, 0)
    reshards = [op for op in program.ops if op.kind is OpKind.RESHARD]
    assert all(op.layer == stages[op.stage].layers[0] for op in reshards if op.phases)


def test_a_compiled_stage_of_the_whole_model_is_the_model() -> None:
    plan = make_plan("tiny_gpt", global_batch=3, gpus=1, assign=cycle(1))
    loaded = load_model(plan.model)
    traced = trace(loaded)
    graph = traced.graph
    stage = StageModule(traced.module, graph.layers, [graph.output])
    batch = loaded.named_inputs(3)
    args = [batch[key] for key in graph.input_keys]
    with torch.no_grad():
        want = loaded.module(**batch)
        got = stage(*args)[graph.output]
    assert torch.equal(got, want)


STAGED = [
    ("tiny_gpt", 6, 2, cycle(2, 2, 2, 1, 1)),
    ("residual", 7, 4, cycle(1, 1, 4, 4, 4, 2, 2, 3)),
    ("branching", 6, 3, cycle(3, 3, 1, 1, 2)),
    ("deep_bn", 6, 2, cycle(2)),
]


@pytest.mark.parametrize(("name", "batch", "gpus", "assign"), STAGED, ids=[c[0] for c in STAGED])
def test_multi_layer_stages_pass_the_check(name: str, batch: int, gpus: int, assign: Assign) -> None:
    plan = make_plan(name, global_batch=batch, gpus=gpus, assign=assign)
    config = RunConfig(steps=3, check=True, optimizer=OptimizerConfig(lr=0.1, momentum=0.9), bucket_mb=0.0005)
    check = train_threads(plan, config)[0].summary.check
    assert check is not None and check.passed and check.max_relative_difference <= 1e-4, check


@pytest.mark.slow
@pytest.mark.parametrize("assign", [pytest.param(cycle(2), marks=pytest.mark.heavy), cycle(2, 2, 2, 1, 1, 1)],
                         ids=["data-parallel", "burst"])  # burst stages cover data-parallel ones
def test_dropout_in_place_ops_and_a_tied_head_in_stages_stay_exact(tmp_path: Path, capfd, assign: Assign) -> None:
    # Real processes: thread ranks share the process's default generator, which per-sample draws reseed.
    plan_path = tmp_path / "plan.json"
    make_plan_for(REPO / "tests/models/zoo/attn_shapes.py", global_batch=5, gpus=2, assign=assign).save(plan_path)
    proc, _ = deeppool_run(capfd, plan_path, "--nproc", "2", "--steps", "2", "--check", "--lr", "0.05", "--out",
                           str(tmp_path / "out"))
    assert proc.code == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["check"]["passed"] and summary["check"]["max_relative_difference"] <= 1e-4, summary["check"]


def test_layers_are_handed_to_the_reducer_in_backward_order_as_soon_as_they_are_ready() -> None:
    stage = Stage(index=0, layers=("a", "b", "c"), gpus=2)
    handed: list[str] = []
    overlap = StageOverlap(stage, {"a": ("a.w",), "b": ("b.w", "b.b"), "c": ("c.w",)},
                           lambda layer, ranks: handed.append(f"{layer}@{len(ranks)}"))
    overlap.start()
    overlap.ready("b.w")
    overlap.ready("b.b")
    assert handed == []  # 'c' (last layer, first in backward) is not ready yet
    overlap.ready("c.w")
    assert handed == ["c@2", "b@2"]
    overlap.finish()  # 'a' got no gradient: handed over at the end, in order
    assert handed == ["c@2", "b@2", "a@2"] and not overlap.active


def test_all_reduce_overlaps_the_backward_and_stays_exact() -> None:
    plan = make_plan("mlp", global_batch=6, gpus=2, assign=cycle(2))
    calls: list[tuple[int, str, bool]] = []
    original = Engine._reduce_layer

    def reduce_layer(engine: Engine, layer: str, ranks: tuple[int, ...]) -> None:
        calls.append((engine.rank, layer, torch.is_grad_enabled()))
        original(engine, layer, ranks)

    config = RunConfig(steps=2, check=True, optimizer=OptimizerConfig(lr=0.1), bucket_mb=0.0005)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Engine, "_reduce_layer", reduce_layer)
        check = train_threads(plan, config)[0].summary.check
    assert check is not None and check.passed, check
    inside = [layer for _, layer, grad_mode in calls if not grad_mode]  # called from inside autograd's backward
    assert inside, calls
