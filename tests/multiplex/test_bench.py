"""`deeppool multiplex bench`'s files, with the runs faked: one object per mode, and the simulator's input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deeppool.errors import DeeppoolError
from deeppool.executor.config import RunConfig
from deeppool.multiplex.bench import bench, write_interference
from deeppool.multiplex.config import BackgroundConfig, MuxMode

MODES = [MuxMode.NONE, MuxMode.SCHED_IDLE, MuxMode.GATE]


def faked(measured: dict[str, tuple[float, float | None]]):
    """A runner whose runs measured ``mode: (fg slowdown, recovered share or None)``."""

    def run(plan, *, background: BackgroundConfig, config: RunConfig) -> dict:
        slowdown, recovered = measured[background.mode.value]
        assert config.out_dir is not None and config.out_dir.name == background.mode.value
        return {"multiplex": {
            "mode": background.mode.value, "fg_alone_ms": 10.0, "fg_shared_ms": 10.0 * (1 + slowdown),
            "fg_slowdown": slowdown, "alone_steps": 9, "shared_steps": 9, "idle_rank_ms_per_iteration": 4.0,
            "planned_idle_rank_ms_per_iteration": 0.1, "bg_busy_s": 1.0, "bg_steps": 10, "bg_samples": 80,
            "bg_samples_per_s": 50.0, "recovered_fraction": recovered, "bg_ms_per_iteration": 2.0,
            "fg_taken_ms_per_iteration": 16 * slowdown, "net_gain": 1.1, "bg_loss_first": 2.0,
            "bg_loss_last": 1.0, "bg_pids": [1], "bg_errors": [], "fg_iteration_ms": 10.0 * (1 + slowdown),
            "efficiency_by_window_ms": [{"window_ms": 4.0, "efficiency": 0.5}],
        }}

    return run


def test_bench_writes_one_object_per_mode_and_the_gated_modes_interference(tmp_path: Path) -> None:
    config = BackgroundConfig(model=tmp_path / "bg.py", slowdown_target=0.05)
    # sched_idle is free-running: its work is not measured in windows, so it is never the simulator's input
    runner = faked({"none": (0.3, None), "sched_idle": (0.01, None), "gate": (0.02, 0.35)})
    reports = bench(tmp_path / "plan.json", config, MODES, config=RunConfig(steps=10), out=tmp_path, runner=runner)
    assert [r.mode for r in reports] == ["none", "sched_idle", "gate"]
    written = json.loads((tmp_path / "multiplex.json").read_text())
    for mode in ("none", "sched_idle", "gate"):
        assert {"fg_slowdown", "recovered_fraction", "fg_taken_ms_per_iteration", "fg_iteration_ms"} <= set(written[mode])
    assert written["sched_idle"]["recovered_fraction"] is None
    write_interference(reports, config.slowdown_target, tmp_path)
    measured = json.loads((tmp_path / "interference.json").read_text())
    assert measured["mode"] == "gate"
    assert measured["fg_slowdown"] == 1.02 and measured["bg_efficiency"] == 0.35
    assert measured["efficiency_by_window_ms"] == [{"window_ms": 4.0, "efficiency": 0.5}]


def test_no_interference_is_written_when_the_gated_mode_slowed_the_foreground_past_the_target(tmp_path: Path) -> None:
    config = BackgroundConfig(model=tmp_path / "bg.py", slowdown_target=0.05)
    (tmp_path / "interference.json").write_text("{}")  # an older run's: it must not stand for this one
    runner = faked({"none": (0.3, None), "sched_idle": (0.01, None), "gate": (0.08, 0.9)})
    reports = bench(tmp_path / "plan.json", config, MODES, config=RunConfig(steps=10), out=tmp_path, runner=runner)
    with pytest.raises(DeeppoolError, match=r"not written: no gated mode .* slowed at most 5% .*gate \+8.0% recovering 90%"):
        write_interference(reports, config.slowdown_target, tmp_path)
    assert not (tmp_path / "interference.json").exists() and (tmp_path / "multiplex.json").exists()


def test_free_running_modes_alone_give_no_interference(tmp_path: Path) -> None:
    config = BackgroundConfig(model=tmp_path / "bg.py", slowdown_target=0.05)
    runner = faked({"none": (0.01, None), "sched_idle": (0.01, None)})
    reports = bench(tmp_path / "plan.json", config, MODES[:2], config=RunConfig(steps=10), out=tmp_path, runner=runner)
    with pytest.raises(DeeppoolError, match="no gated mode \\(gate, priority\\) ran"):
        write_interference(reports, config.slowdown_target, tmp_path)


def test_a_run_that_reports_an_impossible_share_is_refused(tmp_path: Path) -> None:
    config = BackgroundConfig(model=tmp_path / "bg.py", slowdown_target=0.05)
    runner = faked({"gate": (0.0, 297.14)})
    with pytest.raises(DeeppoolError, match="impossible multiplexing figures"):
        bench(tmp_path / "plan.json", config, [MuxMode.GATE], config=RunConfig(steps=10), out=tmp_path, runner=runner)
    assert not (tmp_path / "multiplex.json").exists()
