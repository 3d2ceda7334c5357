"""`deeppool multiplex bench`'s files, with the runs faked: one object per mode, and the simulator's input."""

from __future__ import annotations

import json
from pathlib import Path

from deeppool.executor.config import RunConfig
from deeppool.multiplex.bench import bench
from deeppool.multiplex.config import BackgroundConfig, MuxMode


def fake_run(plan, *, background: BackgroundConfig, config: RunConfig) -> dict:
    slowdown, recovered = {"none": (0.3, 1.5), "sched_idle": (0.04, 0.4), "gate": (0.02, 0.35)}[background.mode.value]
    assert config.out_dir is not None and config.out_dir.name == background.mode.value
    return {"multiplex": {
        "mode": background.mode.value, "fg_alone_ms": 10.0, "fg_shared_ms": 10.0 * (1 + slowdown),
        "fg_slowdown": slowdown, "alone_steps": 9, "shared_steps": 9, "idle_rank_ms_per_iteration": 4.0,
        "planned_idle_rank_ms_per_iteration": 0.1, "bg_busy_s": 1.0, "bg_steps": 10, "bg_samples": 80,
        "bg_samples_per_s": 50.0, "recovered_fraction": recovered, "net_gain": 1.1, "bg_loss_first": 2.0,
        "bg_loss_last": 1.0, "bg_pids": [1], "bg_errors": [], "fg_iteration_ms": 10.0 * (1 + slowdown),
        "efficiency_by_window_ms": [{"window_ms": 4.0, "efficiency": 0.5}],
    }}


def test_bench_writes_one_object_per_mode_and_the_measured_interference(tmp_path: Path) -> None:
    config = BackgroundConfig(model=tmp_path / "bg.py", slowdown_target=0.05)
    reports = bench(tmp_path / "plan.json", config, [MuxMode.NONE, MuxMode.SCHED_IDLE, MuxMode.GATE],
                    config=RunConfig(steps=10), out=tmp_path, runner=fake_run)
    assert [r.mode for r in reports] == ["none", "sched_idle", "gate"]
    written = json.loads((tmp_path / "multiplex.json").read_text())
    for mode in ("none", "sched_idle", "gate"):
        assert {"fg_slowdown", "recovered_fraction", "bg_samples_per_s", "fg_iteration_ms"} <= set(written[mode])
    measured = json.loads((tmp_path / "interference.json").read_text())
    assert measured["mode"] == "sched_idle"  # the most recovered within the target; "none" is only the baseline
    assert measured["fg_slowdown"] == 1.04 and measured["bg_efficiency"] == 0.4
    assert measured["efficiency_by_window_ms"] == [{"window_ms": 4.0, "efficiency": 0.5}]
