"""Training features, each checked step by step against single-process training (``--check``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from deeppool.errors import DeeppoolError
from deeppool.executor.config import OptimizerConfig, RunConfig, Schedule, ScheduleKind, Training
from deeppool.executor.training.reference import CheckResult
from deeppool.model.loading import load_model
from deeppool.plans import Plan
from tests.executor.plans import cycle, make_plan
from tests.executor.test_executor_exact import train_threads
from tests.executor.test_executor_processes import deeppool_run


def loader(plan: Plan, batches: int) -> DataLoader:
    """``batches`` different global batches of the model's kind of data, in a fixed order."""
    loaded = load_model(plan.model)
    size = plan.global_batch * batches
    inputs = loaded.inputs(size)
    return DataLoader(TensorDataset(*inputs, loaded.targets(size)), batch_size=plan.global_batch, shuffle=False)


def pairs(data: DataLoader) -> list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]:
    return [(tuple(item[:-1]), item[-1]) for item in data]


def checked(plan: Plan, training: Training, steps: int = 3, momentum: float = 0.9) -> tuple[CheckResult, dict]:
    config = RunConfig(steps=steps, check=True, optimizer=OptimizerConfig(lr=0.1, momentum=momentum),
                       bucket_mb=0.0005, training=training)
    data = pairs(loader(plan, steps * training.accumulate))
    results = train_threads(plan, config, data=data)
    check = results[0].summary.check
    assert check is not None
    return check, results[0].params


@pytest.mark.parametrize(("name", "batch", "assign"), [("mlp", 6, cycle(2, 2, 1)), ("residual", 7, cycle(2, 1))])
def test_gradient_accumulation_equals_single_process_accumulation(name: str, batch: int, assign) -> None:
    plan = make_plan(name, global_batch=batch, gpus=2, assign=assign)
    check, accumulated = checked(plan, Training(accumulate=3))
    assert check.passed and check.max_relative_difference <= 1e-4, check
    _, single = checked(plan, Training(accumulate=1))
    assert any(not torch.equal(accumulated[n], single[n]) for n in single)  # three micro-batches, not one


def test_clipping_by_the_global_norm_across_groups() -> None:
    plan = make_plan("tiny_gpt", global_batch=6, gpus=2, assign=cycle(2, 1))
    check, clipped = checked(plan, Training(clip_norm=0.05))
    assert check.passed and check.max_relative_difference <= 1e-4, check
    _, free = checked(plan, Training())
    assert any(not torch.allclose(clipped[n], free[n]) for n in free)  # the bound is tight enough to clip


def test_an_lr_schedule_is_followed_step_by_step() -> None:
    plan = make_plan("mlp", global_batch=6, gpus=2, assign=cycle(1, 2))
    schedule = Schedule(kind=ScheduleKind.COSINE, warmup_steps=2, total_steps=4)
    check, _ = checked(plan, Training(schedule=schedule, accumulate=2, clip_norm=1.0), steps=4)
    assert check.passed and check.max_relative_difference <= 1e-4, check


def test_schedule_factors() -> None:
    cosine = Schedule(kind=ScheduleKind.COSINE, warmup_steps=2, total_steps=6)
    assert [cosine.factor(s) for s in range(7)] == pytest.approx([0.5, 1.0, 1.0, 0.8535534, 0.5, 0.1464466, 0.0])
    linear = Schedule(kind=ScheduleKind.LINEAR, warmup_steps=0, total_steps=4)
    assert [linear.factor(s) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert Schedule().factor(100) == 1.0
    with pytest.raises(DeeppoolError, match="--accumulate 0"):
        Training(accumulate=0)
    with pytest.raises(DeeppoolError, match="--clip-norm"):
        Training(clip_norm=0.0)


@pytest.mark.slow
def test_the_command_line_trains_with_every_feature_and_passes_the_check(tmp_path: Path, capfd) -> None:
    plan_path = tmp_path / "plan.json"
    make_plan("tiny_gpt", global_batch=5, gpus=2, assign=cycle(2, 2, 1)).save(plan_path)
    proc, _ = deeppool_run(capfd, plan_path, "--nproc", "2", "--steps", "3", "--check", "--lr", "0.1", "--accumulate", "2",
                           "--clip-norm", "0.5", "--lr-schedule", "cosine", "--lr-warmup", "1",
                           "--out", str(tmp_path / "out"))
    assert proc.code == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["check"]["passed"] and summary["check"]["max_relative_difference"] <= 1e-4, summary["check"]
