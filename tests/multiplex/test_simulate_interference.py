"""`deeppool simulate --interference` replaces the assumed slowdown and efficiency with measured ones."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from deeppool.cluster_sim.cli import app
from deeppool.errors import DeeppoolError
from deeppool.planner.profiling.interference import InterferenceModel

DATA = Path(__file__).resolve().parents[1] / "cluster_sim" / "data"


def simulate(out: Path, cache: Path, *extra: str) -> dict:
    args = ["synthetic", "--gpus", "8", "--gpus-per-node", "4", "--mapping", str(DATA / "mapping.json"),
            "--policy", "burst+bg", "--no-baseline", "--jobs", "20", "--arrival-rate", "60", "--median-duration", "600",
            "--size-mix", "1:0.5,4:0.5", "--no-plots", "--out", str(out), "--cache-dir", str(cache), *extra]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads((out / "metrics.json").read_text())["burst+bg"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One planning cache for the module's simulations: each plans the same trace's models."""
    return tmp_path_factory.mktemp("cache")


def test_measured_interference_changes_the_background_throughput(tmp_path: Path, cache: Path) -> None:
    measured = tmp_path / "interference.json"
    measured.write_text(json.dumps({"mode": "gate", "fg_slowdown": 1.3, "bg_efficiency": 0.05}))
    assumed = simulate(tmp_path / "assumed", cache)
    used = simulate(tmp_path / "measured", cache, "--interference", str(measured))
    run = json.loads((tmp_path / "measured" / "run.json").read_text())
    assert run["interference"]["fg_slowdown"] == 1.3 and run["interference"]["bg_efficiency"] == 0.05
    assert used["bg_throughput"] < assumed["bg_throughput"]


def test_a_file_that_is_not_interference_json_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(DeeppoolError, match="needs fg_slowdown and bg_efficiency"):
        InterferenceModel.measured(bad)
    with pytest.raises(DeeppoolError, match="does not exist"):
        InterferenceModel.measured(tmp_path / "missing.json")


def test_efficiency_follows_the_measured_window_length_bins() -> None:
    model = InterferenceModel(efficiency_by_window_ms=((1.0, 0.2), (4.0, 0.6), (16.0, 0.9)))
    assert model.efficiency(0.5) == 0.0  # shorter than anything measured: not lent
    assert model.efficiency(1.0) == 0.2 and model.efficiency(3.9) == 0.2
    assert model.efficiency(8.0) == 0.6 and model.efficiency(1000.0) == 0.9
    assert model.usable_fraction((0.5, 2.0, 8.0), 20.0) == pytest.approx((0.2 * 2.0 + 0.6 * 8.0) / 20.0)
    assert InterferenceModel(bg_efficiency=0.8).usable_fraction((2.0, 8.0), 20.0) == pytest.approx(0.8 * 10 / 20)
    with pytest.raises(DeeppoolError, match="increasing window lengths"):
        InterferenceModel(efficiency_by_window_ms=((4.0, 0.5), (1.0, 0.5)))


def test_a_curve_that_fills_no_window_of_the_plans_lends_nothing(tmp_path: Path, cache: Path) -> None:
    curve = [{"window_ms": 1e6, "efficiency": 1.0}]  # only windows of 1000 s and longer would be filled
    measured = tmp_path / "interference.json"
    measured.write_text(json.dumps({"fg_slowdown": 1.0, "bg_efficiency": 1.0, "efficiency_by_window_ms": curve}))
    flat = tmp_path / "flat.json"
    flat.write_text(json.dumps({"fg_slowdown": 1.0, "bg_efficiency": 1.0}))
    with_curve = simulate(tmp_path / "curve", cache, "--interference", str(measured))
    without = simulate(tmp_path / "flat", cache, "--interference", str(flat))
    assert with_curve["bg_throughput"] < without["bg_throughput"]


def test_a_window_holds_only_whole_pieces_of_the_guests_step() -> None:
    model = InterferenceModel(bg_efficiency=1.0)
    assert model.usable_fraction((0.9, 3.1, 10.0), 20.0, piece_ms=2.0) == pytest.approx((0 + 2 + 10) / 20)
    assert model.usable_fraction((0.9, 3.1), 20.0, piece_ms=5.0) == 0.0  # 162 ms VGG steps fit no 3 ms gap
    assert model.usable_fraction((0.9, 3.1), 20.0) == pytest.approx(4.0 / 20)
    curve = InterferenceModel(efficiency_by_window_ms=((1.0, 0.5), (8.0, 0.9)))
    assert curve.longest_usable_window_ms((0.5, 4.0, 2.0), 20.0) == 4.0
    assert curve.longest_usable_window_ms((0.5,), 20.0) == 0.0


def test_a_rank_that_runs_no_layer_is_filled_whole_whatever_the_pieces() -> None:
    """Its window runs into the next iteration's with no foreground work between: a piece may cross."""
    model = InterferenceModel(bg_efficiency=0.8)
    assert model.usable_fraction((20.0,), 20.0, piece_ms=3.0) == pytest.approx(0.8)  # not 18 ms of 20
    assert model.usable_fraction((20.0,), 20.0, piece_ms=30.0) == pytest.approx(0.8)  # nor none
    assert model.usable_fraction((19.0,), 20.0, piece_ms=3.0) == pytest.approx(0.8 * 18 / 20)  # a busy rank's
    assert model.longest_usable_window_ms((20.0,), 20.0) == math.inf
    curve = InterferenceModel(efficiency_by_window_ms=((1.0, 0.5), (8.0, 0.9)))
    assert curve.usable_fraction((4.0,), 4.0, piece_ms=3.0) == pytest.approx(0.5)  # at its length's efficiency
    assert curve.longest_usable_window_ms((0.5,), 0.5) == 0.0
