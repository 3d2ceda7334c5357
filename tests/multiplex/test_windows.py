"""The one-GPU window sweep (``deeppool multiplex windows``) through the fake GPU on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deeppool.device.cuda import CudaGpu
from deeppool.planner.profiling.interference import InterferenceModel
from tests.entry import deeppool

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
