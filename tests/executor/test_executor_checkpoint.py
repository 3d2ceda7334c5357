"""Checkpoints: a resumed run is bit-identical to an uninterrupted one; a torn checkpoint is skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deeppool.errors import DeeppoolError
from deeppool.executor.api import RankResult
from deeppool.executor.config import (
    CheckpointConfig,
    OptimizerConfig,
    RunConfig,
    Schedule,
    ScheduleKind,
    Training,
)
from deeppool.executor.training.checkpoint import MARKER, export, latest, step_dir
from deeppool.model.loading import load_model
from deeppool.plans import Plan
from tests.entry import deeppool
from tests.executor.plans import cycle, make_plan
from tests.executor.test_executor_exact import train_threads
from tests.executor.test_executor_processes import deeppool_run
from tests.executor.test_executor_training import loader, pairs

PLAN = make_plan("residual", global_batch=7, gpus=2, assign=cycle(2, 2, 1))
TRAINING = Training(accumulate=2, schedule=Schedule(kind=ScheduleKind.COSINE, warmup_steps=1, total_steps=4))


def train(steps: int, checkpoint: CheckpointConfig | None) -> list[RankResult]:
    config = RunConfig(steps=steps, optimizer=OptimizerConfig(lr=0.1, momentum=0.9), bucket_mb=0.0005,
                       training=TRAINING, checkpoint=checkpoint)
    return train_threads(PLAN, config, data=pairs(loader(PLAN, 4 * TRAINING.accumulate)))


def assert_same(got: list[RankResult], want: list[RankResult]) -> None:
    for mine, theirs in zip(got, want, strict=True):
        assert mine.params.keys() == theirs.params.keys()
        assert all(torch.equal(mine.params[name], theirs.params[name]) for name in theirs.params)
        assert all(torch.equal(mine.buffers[name], theirs.buffers[name]) for name in theirs.buffers)


def test_a_resumed_run_is_bit_identical_to_an_uninterrupted_one(tmp_path: Path) -> None:
    whole = train(4, None)
    train(2, CheckpointConfig(directory=tmp_path, every=2))
    assert latest(tmp_path) == 2 and sorted(p.name for p in step_dir(tmp_path, 2).iterdir()) == [
        MARKER, "group1.pt", "group2.pt", "run.pt"]
    resumed = train(4, CheckpointConfig(directory=tmp_path, every=2, resume=True))
    assert_same(resumed, whole)
    assert resumed[0].losses == whole[0].losses[2:]


def test_a_checkpoint_without_its_marker_is_skipped(tmp_path: Path) -> None:
    train(4, CheckpointConfig(directory=tmp_path, every=2))
    (step_dir(tmp_path, 4) / MARKER).unlink()  # as if a rank died while step 4's shards were written
    (step_dir(tmp_path, 4) / "group2.pt").unlink()
    assert latest(tmp_path) == 2
    resumed = train(4, CheckpointConfig(directory=tmp_path, resume=True))
    assert_same(resumed, train(4, None))


def test_export_joins_the_group_shards_into_the_original_models_state_dict(tmp_path: Path) -> None:
    results = train(2, CheckpointConfig(directory=tmp_path, every=2))
    done, state = export(tmp_path)
    assert done == 2
    model = load_model(PLAN.model).module
    model.load_state_dict(state, strict=True)
    held = {**results[0].params, **results[0].buffers}  # rank 0 is in every layer group
    assert state.keys() == held.keys()
    assert all(torch.equal(state[name], held[name]) for name in held)
    with pytest.raises(DeeppoolError, match="no complete checkpoint after 3 steps"):
        export(tmp_path, 3)


def test_check_and_resume_together_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DeeppoolError, match="--check"):
        RunConfig(check=True, checkpoint=CheckpointConfig(directory=tmp_path, resume=True))


@pytest.mark.slow
def test_the_command_line_resumes_exactly(tmp_path: Path, capfd) -> None:
    plan_path = tmp_path / "plan.json"
    make_plan("tiny_gpt", global_batch=5, gpus=2, assign=cycle(2, 2, 1)).save(plan_path)
    common = ["--nproc", "2", "--lr", "0.1", "--momentum", "0.9", "--lr-warmup", "3"]  # independent of --steps

    def losses(out: str, *args: str) -> list[float]:
        proc, _ = deeppool_run(capfd, plan_path, *common, "--out", str(tmp_path / out), *args)
        assert proc.code == 0, proc.stderr[-3000:]
        return json.loads((tmp_path / out / "summary.json").read_text())["losses"]

    whole = losses("whole", "--steps", "4")
    ckpt = str(tmp_path / "ckpt")
    first = losses("first", "--steps", "2", "--checkpoint-dir", ckpt, "--checkpoint-every", "2")
    second = losses("second", "--steps", "4", "--checkpoint-dir", ckpt, "--resume")
    assert first + second == whole
    exported = tmp_path / "model.pt"
    result = deeppool(capfd, "export", ckpt, "--out", str(exported), "--plan", str(plan_path))
    assert result.code == 0 and "after 2 steps" in result.stdout, result.stderr
    load_model(Plan.load(plan_path).model).module.load_state_dict(torch.load(exported), strict=True)


def test_a_damaged_shard_is_named_and_the_newest_intact_checkpoint_is_used(tmp_path: Path, capsys) -> None:
    train(4, CheckpointConfig(directory=tmp_path, every=2))
    shard = step_dir(tmp_path, 4) / "group2.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a copy cut short; its marker still there
    assert latest(tmp_path) == 4
    warnings: list[str] = []
    done, state = export(tmp_path, warn=warnings.append)
    assert done == 2 and state
    assert len(warnings) == 1 and str(shard) in warnings[0] and "the one after 2 steps" in warnings[0]
    with pytest.raises(DeeppoolError, match="group2.pt' is damaged"):
        export(tmp_path, 4)  # asked for by its step: no fallback, one error naming the shard
    resumed = train(4, CheckpointConfig(directory=tmp_path, resume=True))
    assert_same(resumed, train(4, None))  # resumed from step 2, as if the damaged one had never been written
    assert "group2.pt' is damaged" in capsys.readouterr().out
    exported = deeppool(capsys, "export", str(tmp_path), "--out", str(tmp_path / "model.pt"))
    assert exported.code == 0 and "after 2 steps" in exported.stdout and "Traceback" not in exported.stderr
    assert exported.stderr.startswith("warning: the checkpoint after 4 steps is damaged: shard ")
    zeroed = step_dir(tmp_path, 2) / "run.pt"
    zeroed.write_bytes(bytes(zeroed.stat().st_size))
    with pytest.raises(DeeppoolError, match="every complete checkpoint .* is damaged"):
        train(4, CheckpointConfig(directory=tmp_path, resume=True))


def test_a_stop_file_stops_every_rank_after_the_same_step_resumably(tmp_path: Path) -> None:
    whole = train(4, None)
    stop = tmp_path / "stop"
    stop.write_text("")
    config = RunConfig(steps=4, optimizer=OptimizerConfig(lr=0.1, momentum=0.9), bucket_mb=0.0005,
                       training=TRAINING, out_dir=tmp_path / "out",
                       checkpoint=CheckpointConfig(directory=tmp_path / "ckpt", resume=True, stop_file=stop))
    stopped = train_threads(PLAN, config, data=pairs(loader(PLAN, 4 * TRAINING.accumulate)))
    assert [len(rank.losses) for rank in stopped] == [1, 1]  # both ranks stopped after the first step
    record = json.loads((tmp_path / "out" / "stopped.json").read_text())
    assert record["steps_done"] == 1 and latest(tmp_path / "ckpt") == 1
    stop.unlink()
    resumed = train_threads(PLAN, config, data=pairs(loader(PLAN, 4 * TRAINING.accumulate)))
    assert_same(resumed, whole)
    assert resumed[0].losses == whole[0].losses[1:]
