"""``benchmarks/gpu.py``: its dry run through the fake GPU passes here, and it finds every gpu test."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deeppool.planner.profiling.interference import InterferenceModel

REPO = Path(__file__).resolve().parents[1]


def test_every_gpu_marked_test_is_in_the_checklists_files() -> None:
    listed = set(_checklist_files())
    marked = {str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
              if p != Path(__file__) and "pytest.mark.gpu" in p.read_text()}
    assert marked == listed


def _checklist_files() -> tuple[str, ...]:
    """``GPU_TEST_FILES`` of ``benchmarks/gpu.py`` (read, not imported: a script, not a module)."""
    tree = ast.parse((REPO / "benchmarks" / "gpu.py").read_text())
    (value,) = [node.value for node in tree.body if isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "GPU_TEST_FILES" for t in node.targets)]
    return ast.literal_eval(value)


@pytest.mark.slow
@pytest.mark.heavy
def test_the_dry_run_passes_within_its_budget_and_writes_one_report(tmp_path: Path) -> None:
    budget_s = 480
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "benchmarks/gpu.py", "--dry-run", "--out", str(tmp_path), "--budget-s",
                           str(budget_s)], cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu-report.json").read_text())
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert report["dry_run"] and status == {"gpu-tests": "passed", "interference": "passed", "device-time": "passed",
                                            "profiles": "passed", "nccl-vs-ddp": "skipped", "fidelity": "skipped"}
    assert list(status) == ["gpu-tests", "interference", "device-time", "profiles", "nccl-vs-ddp", "fidelity"]
    figures = {c["name"]: c["figures"] for c in report["checks"]}
    assert figures["gpu-tests"]["tests"] >= 7
    assert figures["interference"]["drill"]["pieces_checked"] > 0 and figures["interference"]["drill"]["dropped"] >= 3
    assert [w["window_ms"] for w in figures["interference"]["windows"]][:2] == [0.5, 30.0]
    assert InterferenceModel.measured(tmp_path / "interference.json").efficiency_by_window_ms
    natural = json.loads((tmp_path / "interference.json").read_text())["natural_windows"]
    assert [w["window"] for w in natural] == [w["window"] for w in figures["interference"]["natural_windows"]] \
        == ["data loading", "optimizer step"]
    assert [w["window_ms"] for w in figures["interference"]["mps_windows"]][:2] == [2.0, 30.0]
    assert json.loads((tmp_path / "mps" / "interference.json").read_text())["mode"] == "mps"
    assert InterferenceModel.measured(tmp_path / "mps" / "interference.json").efficiency_by_window_ms
    mlp = figures["device-time"]["background_mlp.py"]
    assert mlp["captured"] == mlp["layers"] == 5 and mlp["stage_fwd_ms"] >= max(mlp["device_fwd_ms"], mlp["host_fwd_ms"])
    assert 0 <= figures["profiles"]["background_mlp.py"]["median_error"]
    assert "DRY RUN" in (tmp_path / "gpu-report.md").read_text()
    assert time.perf_counter() - started < budget_s + 120  # no check starts after the budget; the last may overrun


def test_a_spent_budget_skips_every_check_and_still_writes_the_report(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "benchmarks/gpu.py", "--dry-run", "--out", str(tmp_path), "--budget-s", "0"],
                          cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    report = json.loads((tmp_path / "gpu-report.json").read_text())
    assert [(c["name"], c["status"], c["why"]) for c in report["checks"]] == [
        (name, "skipped", "budget spent (--budget-s 0)")
        for name in ("gpu-tests", "interference", "device-time", "profiles", "nccl-vs-ddp", "fidelity")]
    assert "budget 0 s" in (tmp_path / "gpu-report.md").read_text()


def test_without_a_gpu_the_real_run_is_refused_in_one_line(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "benchmarks/gpu.py", "--out", str(tmp_path / "out")], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0 and done.stderr.strip() == (
        "error: no GPU is visible here: run on a machine with one, or give --dry-run")
    assert not (tmp_path / "out").exists()
