"""Map-style datasets: each rank loads only its rows, in a seeded order of epochs; training on them
matches single-process training on the same global batches, and a resumed run continues the data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from deeppool.errors import DeeppoolError
from deeppool.executor.config import CheckpointConfig, DataConfig, OptimizerConfig, RunConfig, Training
from deeppool.executor.engine.data import DatasetBatches, EpochOrder, load_dataset, needed_rows
from deeppool.executor.training.checkpoint import load_run
from deeppool.model.loading import load_model
from deeppool.plans import Plan
from tests.executor.plans import cycle, make_plan, traced_graph
from tests.executor.test_executor_checkpoint import assert_same
from tests.executor.test_executor_exact import train_threads
from tests.executor.test_executor_processes import deeppool_run

RECORDING = Path(__file__).resolve().parent / "data" / "recording.py"


def input_and_output_on(input_gpus: int, output_gpus: int, middle: int = 1):
    """mlp (5 layers): the first layer (reads the inputs) and the last (the loss) on these GPU counts."""
    return lambda i, layer: {0: input_gpus, 4: output_gpus}.get(i, middle)


def test_a_rank_needs_its_rows_of_the_input_and_output_layers() -> None:
    plan = make_plan("mlp", global_batch=8, gpus=8, assign=input_and_output_on(8, 2))
    graph = traced_graph(plan.model.location)
    assert needed_rows(plan, graph, 0) == ((0, 4),)  # rank 0 also runs the middle layers, which read neither
    assert needed_rows(plan, graph, 1) == ((1, 2), (4, 8))  # [1, 2) of the first layer, [4, 8) of the loss
    assert needed_rows(plan, graph, 5) == ((5, 6),)
    assert needed_rows(plan, graph, 1, targets=False) == ((1, 2),)


def test_epochs_are_seeded_permutations_cut_into_whole_batches() -> None:
    order = EpochOrder(length=20, global_batch=6, seed=3)
    assert order.per_epoch == 3 and order.position(7) == (2, 1)
    whole = ((0, 6),)
    for epoch in range(2):
        permutation = torch.randperm(20, generator=torch.Generator().manual_seed(3 + epoch)).tolist()
        seen = [i for batch in range(3) for i in order.samples(epoch * 3 + batch, whole)]
        assert seen == permutation[:18]  # the last 2 samples of the epoch's order are dropped
    assert order.samples(4, ((1, 2), (4, 6))) == [order.samples(4, whole)[i] for i in (1, 4, 5)]
    with pytest.raises(DeeppoolError, match="fewer than the plan's global batch of 6"):
        EpochOrder(length=5, global_batch=6)


def test_bad_data_factories_are_one_line() -> None:
    with pytest.raises(DeeppoolError, match="is not module:factory"):
        DataConfig(factory="nocolon")
    with pytest.raises(DeeppoolError, match="--data-workers"):
        DataConfig(factory="a:b", workers=-1)
    with pytest.raises(DeeppoolError, match="no callable 'missing'"):
        load_dataset(f"{RECORDING}:missing")
    with pytest.raises(DeeppoolError, match="not a map-style"):
        load_dataset(f"{RECORDING}:Path")
    assert len(load_dataset(f"{RECORDING}:dataset")) == 20


def dataset(plan: Plan, size: int) -> TensorDataset:
    loaded = load_model(plan.model)
    return TensorDataset(loaded.inputs(size)[0], loaded.targets(size))


def test_a_dataset_trains_exactly_and_reports_its_epochs() -> None:
    plan = make_plan("residual", global_batch=7, gpus=2, assign=cycle(2, 1))
    config = RunConfig(steps=3, check=True, optimizer=OptimizerConfig(lr=0.1, momentum=0.9), bucket_mb=0.0005,
                       training=Training(accumulate=2))
    results = train_threads(plan, config, data=dataset(plan, 17))  # 2 batches per epoch, 3 samples dropped
    summary = results[0].summary
    assert summary is not None and summary.check is not None
    assert summary.check.passed and summary.check.max_relative_difference <= 1e-4, summary.check
    assert summary.data is not None and summary.data.to_json()["next"] == {"epoch": 3, "batch": 0}
    assert summary.data.epochs == 3.0


def test_a_resumed_run_continues_the_data_bit_identically(tmp_path: Path) -> None:
    plan = make_plan("mlp", global_batch=6, gpus=3, assign=cycle(3, 1, 2))
    data = dataset(plan, 20)  # 3 batches per epoch: the checkpoint falls inside the second epoch

    def train(steps: int, checkpoint: CheckpointConfig | None):
        config = RunConfig(steps=steps, optimizer=OptimizerConfig(lr=0.1, momentum=0.9), bucket_mb=0.0005,
                           training=Training(accumulate=2), checkpoint=checkpoint)
        return train_threads(plan, config, data=data)

    whole = train(4, None)
    train(2, CheckpointConfig(directory=tmp_path, every=2))
    assert load_run(tmp_path, 2).progress["position"] == 4
    resumed = train(4, CheckpointConfig(directory=tmp_path, every=2, resume=True))
    assert_same(resumed, whole)
    assert resumed[0].losses == whole[0].losses[2:]


def recorded(folder: Path, rank: int) -> list[int]:
    path = folder / f"rank{rank}.txt"
    return [int(line) for line in path.read_text().split()] if path.exists() else []


@pytest.mark.slow
def test_the_command_line_loads_only_each_ranks_rows_and_passes_the_check(tmp_path: Path, capfd,
                                                                          monkeypatch) -> None:
    plan = make_plan("mlp", global_batch=6, gpus=3, assign=input_and_output_on(3, 2))
    plan_path = tmp_path / "plan.json"
    plan.save(plan_path)
    record = tmp_path / "record"
    record.mkdir()
    monkeypatch.setenv("DEEPPOOL_TEST_RECORD", str(record))
    args = ["--nproc", "3", "--steps", "4", "--lr", "0.1", "--data", f"{RECORDING}:dataset", "--data-seed", "7"]
    proc, _ = deeppool_run(capfd, plan_path, *args, "--out", str(tmp_path / "out"))
    assert proc.code == 0, proc.stderr[-3000:]
    order = EpochOrder(length=20, global_batch=6, seed=7)
    graph = traced_graph(plan.model.location)
    for rank in range(3):
        want = [i for step in range(4) for i in order.samples(step, needed_rows(plan, graph, rank))]
        assert recorded(record, rank) == want, rank
    assert len(recorded(record, 2)) == 2 * 4  # rank 2 runs only the first layer: 2 of 6 rows
    data = json.loads((tmp_path / "out" / "summary.json").read_text())["data"]
    assert data["batches_trained"] == 4 and data["next"] == {"epoch": 1, "batch": 1} and data["seed"] == 7
    monkeypatch.delenv("DEEPPOOL_TEST_RECORD")
    proc, _ = deeppool_run(capfd, plan_path, *args, "--check", "--out", str(tmp_path / "check"))
    assert proc.code == 0, proc.stderr[-3000:]
    check = json.loads((tmp_path / "check" / "summary.json").read_text())["check"]
    assert check["passed"] and check["max_relative_difference"] <= 1e-4, check


def test_data_loader_workers_load_the_same_rows() -> None:
    plan = make_plan("mlp", global_batch=6, gpus=3, assign=input_and_output_on(3, 2))
    loaded = load_model(plan.model)
    order = EpochOrder(length=20, global_batch=6, seed=1)
    spans = ((2, 6),)
    inline = DatasetBatches(dataset(plan, 20), order, spans, loaded)
    workers = DatasetBatches(dataset(plan, 20), order, spans, loaded, workers=2)
    for index in (0, 1, 2, 3, 5):  # across an epoch, and a jump (a resumed run)
        got, want = workers(index), inline(index)
        assert torch.equal(got.rows("input", 3, 6), want.rows("input", 3, 6))
        assert torch.equal(got.target_rows(2, 6), want.target_rows(2, 6))
        assert got.spans == spans and len(want.targets) == 4
