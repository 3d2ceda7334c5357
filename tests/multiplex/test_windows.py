"""The one-GPU window sweep (``deeppool multiplex windows``) through the fake GPU on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deeppool.device.cuda import CudaGpu
from deeppool.errors import DeeppoolError
from deeppool.multiplex.mps_windows import alone_step_s, progress_s
from deeppool.planner.profiling.interference import InterferenceModel
from tests.entry import deeppool
from tests.multiplex.plans import burst_plan

REPO = Path(__file__).resolve().parents[2]
BACKGROUND = str(REPO / "examples" / "background_mlp.py")


def test_the_sweep_lends_each_window_and_writes_what_the_simulator_reads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    done = deeppool(capsys, "multiplex", "windows", "--background", BACKGROUND, "--out", str(tmp_path / "out"),
                    "--windows", "0.5,30,whole", "--per-window", "3", "--dry-run")
    assert done.code == 0, done.stderr
    written = json.loads((tmp_path / "out" / "interference.json").read_text())
    found = written["windows"]
    assert [f["window_ms"] for f in found][:2] == [0.5, 30.0] and found[2]["whole"] and not found[0]["whole"]
    assert all(f["fg_alone_ms"] > 0 and f["fg_lent_ms"] > 0 and 0 <= f["efficiency"] <= 1 for f in found)
    assert found[1]["bg_busy_ms"] > 0  # the background ran in the 30 ms windows
    assert "DRY RUN" in written["source"] and "window 30 ms: foreground" in done.stdout
    model = InterferenceModel.measured(tmp_path / "out" / "interference.json")
    assert [edge for edge, _ in model.efficiency_by_window_ms] == sorted(round(f["window_ms"], 4) for f in found)
    assert model.efficiency(30.0) == pytest.approx(round(found[1]["efficiency"], 4))
    assert model.efficiency(0.1) == 0.0  # shorter than any window measured: not lent
    assert model.fg_slowdown >= 1 and model.bg_piece_ms == 0.5


@pytest.mark.parametrize(("windows", "error"), [("0,1", "above 0 ms"), ("soon", "a length in ms or 'whole'")])
def test_bad_window_lengths_are_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], windows: str,
                                                    error: str) -> None:
    done = deeppool(capsys, "multiplex", "windows", "--background", BACKGROUND, "--out", str(tmp_path / "out"),
                    "--windows", windows, "--dry-run")
    assert done.code != 0 and error in done.stderr and "Traceback" not in done.stderr


@pytest.mark.skipif(CudaGpu().available(), reason="a GPU is here")
def test_without_a_gpu_only_the_dry_run_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    done = deeppool(capsys, "multiplex", "windows", "--background", BACKGROUND, "--out", str(tmp_path / "out"))
    assert done.code != 0 and "needs a CUDA GPU" in done.stderr


@pytest.mark.heavy  # a process started; the checklist's dry run (tests/test_gpu_checklist.py) runs sweep_mps by default
def test_the_mps_sweep_runs_a_client_process_under_the_daemon_beside_the_foreground(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--mux mps`` through the fake: the client is a process started under the (stand-in) MPS daemon with its
    percentage, running freely beside the foreground's loops; its steps' spans become its progress."""
    out = tmp_path / "out"
    done = deeppool(capsys, "multiplex", "windows", "--background", BACKGROUND, "--out", str(out), "--mux", "mps",
                    "--mps-percentage", "40", "--windows", "2,20,whole", "--per-window", "4", "--dry-run")
    assert done.code == 0, done.stderr
    written = json.loads((out / "interference.json").read_text())
    assert written["mode"] == "mps" and "piece_ms" not in written and "mps mode" in written["source"]
    found = written["windows"]
    assert [f["window_ms"] for f in found][:2] == [2.0, 20.0] and found[2]["whole"]
    assert all(f["fg_alone_ms"] > 0 and f["fg_lent_ms"] > 0 and f["bg_busy_ms"] > 0 for f in found)
    assert all(0 < f["efficiency"] <= 1 for f in found)
    calls = (out / "mps" / "mps-calls.txt").read_text().splitlines()
    assert calls == ["nvidia-cuda-mps-control -d", "nvidia-cuda-mps-control quit"]
    spec = json.loads((out / "mps" / "background-rank0.json").read_text())
    assert spec["mode"] == "mps" and spec["device"] == "cpu"
    model = InterferenceModel.measured(out / "interference.json")
    assert model.bg_piece_ms == 0.0 and model.fg_slowdown >= 1


def test_progress_counts_the_share_of_each_step_inside_an_interval() -> None:
    spans = ((0.0, 1.0), (1.0, 3.0), (3.0, 4.0), (5.0, 5.0))
    assert progress_s(spans, (0.5, 3.5), 0.1) == pytest.approx(0.1 * (0.5 + 1.0 + 0.5))
    assert alone_step_s(spans, (0.9, 4.1)) == pytest.approx(1.5)  # (1, 3) and (3, 4) lie wholly inside: median
    assert alone_step_s(spans, (3.2, 3.4)) == pytest.approx(1.0)  # none wholly inside: those overlapping
    with pytest.raises(DeeppoolError, match="ran no step"):
        alone_step_s(spans, (6.0, 7.0))


def test_a_one_rank_plans_natural_windows_are_lent_into_the_same_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--plan``: the plan's own iteration (data loading, forward, loss, backward, the optimizer's step) alone,
    then with the background lent its data-loading windows, then its optimizer-step windows."""
    plan = tmp_path / "plan.json"
    burst_plan(gpus=1, lone=(), global_batch=16).save(plan)
    out = tmp_path / "out"
    done = deeppool(capsys, "multiplex", "windows", "--background", BACKGROUND, "--out", str(out), "--windows", "5",
                    "--per-window", "3", "--plan", str(plan), "--dry-run")
    assert done.code == 0, done.stderr
    written = json.loads((out / "interference.json").read_text())
    natural = {w["window"]: w for w in written["natural_windows"]}
    assert set(natural) == {"data loading", "optimizer step"}
    assert all(w["window_ms"] > 0 and w["fg_alone_ms"] > w["window_ms"] and w["fg_lent_ms"] > 0 and w["windows"] == 3
               and 0 <= w["efficiency"] <= 1 for w in natural.values())
    assert "data loading (" in done.stdout and "optimizer step (" in done.stdout
    assert InterferenceModel.measured(out / "interference.json").fg_slowdown >= 1  # the simulator still reads it
    two = tmp_path / "two.json"
    burst_plan(gpus=2).save(two)
    refused = deeppool(capsys, "multiplex", "windows", "--background", BACKGROUND, "--out", str(tmp_path / "o2"),
                       "--windows", "5", "--plan", str(two), "--dry-run")
    assert refused.code != 0 and "one-rank plan" in refused.stderr and "Traceback" not in refused.stderr
