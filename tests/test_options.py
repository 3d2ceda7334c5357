"""Run options declared once: ``deeppool run``'s options are the config dataclasses' fields, the ranks get the
config as one JSON file that round-trips, and the flags rendered from a config give it back."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from deeppool import options
from deeppool.errors import DeeppoolError
from deeppool.executor.config import (
    Adaptation,
    Backend,
    BatchNormMode,
    CheckpointConfig,
    DataConfig,
    LrScaling,
    Monitor,
    OptimizerConfig,
    RankConfig,
    RunConfig,
    Schedule,
    ScheduleKind,
    Training,
)
from deeppool.multiplex.config import BACKGROUND_KEY, ABSchedule, BackgroundConfig, MuxMode
from deeppool.multiplex.options import RUN_BACKGROUND
from deeppool.options import Default, Given, Group, nested, option
from deeppool.plans import Combine, Optimizer, Precision
from tests.entry import deeppool
from tests.executor.plans import cycle, make_plan, model_path


def _config(tmp_path: Path) -> RunConfig:
    """Every option away from its default."""
    return RunConfig(
        steps=7, warmup=2, optimizer=OptimizerConfig(kind=Optimizer.ADAM, lr=0.05, momentum=0.5),
        backend=Backend.GLOO, timeout_s=30.0, bucket_mb=1.5, check_bound=0.01, out_dir=tmp_path / "out",
        training=Training(accumulate=2, clip_norm=1.0,
                          schedule=Schedule(kind=ScheduleKind.COSINE, warmup_steps=1, total_steps=7)),
        checkpoint=CheckpointConfig(directory=tmp_path / "ckpt", every=3, resume=True),
        policy="grow-batch", monitor_every=5,
        adaptation=Adaptation(monitor=Monitor.GNS, lr_scaling=LrScaling.ADASCALE, base_batch=2, combine=Combine.SUM),
        precision=Precision.BF16, data=DataConfig(factory="tests.executor.data.recording:dataset", seed=3, workers=1),
        batchnorm=BatchNormMode.LOCAL,
    )


def _background(tmp_path: Path) -> BackgroundConfig:
    return BackgroundConfig(model=Path(model_path("mlp")), batch=4, optimizer=OptimizerConfig(kind=Optimizer.ADAM,
                            lr=0.02), mode=MuxMode.SCHED_IDLE, checkpoint_dir=tmp_path / "bg", slowdown_target=0.1,
                            mps_percentage=40, schedule=ABSchedule(block=6))


def test_the_run_config_round_trips_through_json(tmp_path: Path) -> None:
    for config in (RunConfig(), _config(tmp_path)):
        assert RunConfig.from_json(json.loads(json.dumps(config.to_json()))) == config
    background = _background(tmp_path)
    assert BackgroundConfig.from_json(json.loads(json.dumps(background.to_json()))) == background
    rank = RankConfig(run=_config(tmp_path), extra={BACKGROUND_KEY: background.to_json()})
    rank.save(tmp_path / "config.json")
    assert RankConfig.load(tmp_path / "config.json") == rank


def test_a_config_file_leaves_out_defaults_and_names_what_it_does_not_know(tmp_path: Path) -> None:
    assert RunConfig.from_json({"steps": 9, "optimizer": {"lr": 0.5}}) == RunConfig(
        steps=9, optimizer=OptimizerConfig(lr=0.5))
    with pytest.raises(DeeppoolError, match="run config.optimizer: unknown field 'rate' of OptimizerConfig"):
        RunConfig.from_json({"optimizer": {"rate": 0.5}})
    with pytest.raises(DeeppoolError, match="--steps 0 must be at least 1"):  # validated as it is constructed
        RunConfig.from_json({"steps": 0})
    (tmp_path / "other.json").write_text(json.dumps({"artifact": "plan", "schema_version": 1}))
    with pytest.raises(DeeppoolError, match="not a run config JSON"):
        RankConfig.load(tmp_path / "other.json")


def test_the_flags_of_a_config_give_it_back_through_deeppool_run(tmp_path: Path, capsys, monkeypatch) -> None:
    from deeppool.multiplex import api

    plan = tmp_path / "plan.json"
    make_plan("mlp", global_batch=8, gpus=2, assign=cycle(2)).save(plan)
    launched = []
    monkeypatch.setattr(api, "launch_with_background",
                        lambda plan, path, *, nproc, config, background, nodes: launched.append((config, background)))
    config, background = _config(tmp_path), _background(tmp_path)
    args = options.argv(RunConfig, config) + options.argv(RUN_BACKGROUND, background)
    assert "--bg-lr" in args and "--resume" in args and "--check" not in args
    result = deeppool(capsys, "run", str(plan), *args)
    assert result.code == 0, result.stderr
    assert launched == [(config, background)]


def test_run_help_opens_with_a_two_line_example(capsys) -> None:
    lines = [line.strip() for line in deeppool(capsys, "run", "--help").stdout.splitlines() if line.strip()]
    assert lines[0].startswith("Usage: deeppool run")
    assert lines[1].startswith("Example:") and lines[2].startswith("deeppool run plan.json")
    assert lines[3].startswith("Train with PLAN")
    listed = deeppool(capsys, "--help").stdout
    assert "Train with PLAN on --nproc" in listed


@dataclass(frozen=True, kw_only=True)
class _Inner:
    name: str = option(help="a name", flag="--name")
    size: int = option(1, help="a size")


@dataclass(frozen=True, kw_only=True)
class _Outer:
    count: int = option(2, help="how many", command_default=Default(None, "the command's"))
    inner: _Inner | None = nested(default=None, prefix="in-", help_prefix="inner ")
    fixed: int = 0


def test_a_command_takes_a_groups_fields_as_options_and_a_given_builds_the_config() -> None:
    found = {option.flag: option for option in options.options(_Outer)}
    assert list(found) == ["--count", "--in-name", "--in-size"]
    assert found["--in-size"].help == "inner a size" and found["--in-size"].path == "inner.size"
    assert found["--count"].default is None and found["--count"].shown == "the command's"
    assert found["--in-name"].default is None  # the required field of an optional config

    @options.expand(given=Group(_Outer))
    def command(first: str, *, given: Given, last: int = 0) -> tuple[str, Given, int]:
        return first, given, last

    first, given, last = command("a", in_name="x")
    assert (first, last) == ("a", 0) and given["count"] is None and given.present
    assert given.build({"count": 5, "fixed": 1}) == _Outer(count=5, inner=_Inner(name="x"), fixed=1)
    assert command("a")[1].build({"count": 5}) == _Outer(count=5)  # no --in-name: no inner config
    assert options.argv(_Outer, _Outer(count=3, inner=_Inner(name="y", size=4))) == [
        "--count", "3", "--in-name", "y", "--in-size", "4"]
