"""Issue 23: a held-out model (not in benchmarks/models, which the cost model was tuned on), planned and run
with the default flags through ``benchmarks/fidelity.py --zoo``: every per-GPU batch the plan uses is
measured, and on a quiet machine (little work outside the benchmark's own processes) the run's iteration is
within ±15% of the prediction."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.planner.test_hostload import fake_task

REPO = Path(__file__).resolve().parents[2]
ROW = re.compile(r"measured/predicted (?P<ratio>[\d.]+).*"
                 r"other work (?P<other>[\d.]+) runnable \((?P<quiet>quiet|busy)\)")


@pytest.mark.slow
@pytest.mark.heavy
def test_a_held_out_model_with_default_flags_is_predicted_within_15_percent_on_a_quiet_machine(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "fidelity.py"), "--zoo", "--runs", "1", "--nproc", "2",
         "--models", "mobilenet_small", "--steps", "12", "--scatter", str(tmp_path / "zoo.png")],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=1200,
        check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("run 1  mobilenet_small")]
    assert len(rows) == 1 and "stages measured/predicted" in rows[0], done.stdout
    assert (tmp_path / "zoo.png").read_bytes().startswith(b"\x89PNG")
    found = ROW.search(rows[0])
    assert found is not None, rows[0]
    if found["quiet"] != "quiet":
        pytest.skip(f"other work {found['other']} runnable: the ±15% goal holds on a quiet machine (row: {rows[0]})")
    assert abs(float(found["ratio"]) - 1) <= 0.15, rows[0]


def _fidelity() -> SimpleNamespace:
    """benchmarks/fidelity.py's functions (a script, not a package)."""
    return SimpleNamespace(**runpy.run_path(str(REPO / "benchmarks" / "fidelity.py"), run_name="fidelity"))


def test_the_zoo_counts_only_work_outside_its_own_process_tree(tmp_path):
    fidelity = _fidelity()
    for pid, tid, state, parent in [(100, 100, "R", 1), (101, 101, "R", 100), (102, 102, "R", 101),
                                    (102, 103, "R", 101), (200, 200, "R", 1), (200, 201, "R", 1),
                                    (200, 202, "S", 1), (300, 300, "S", 1)]:
        fake_task(tmp_path, pid, tid, state, parent)
    (tmp_path / "self").mkdir()
    assert fidelity.runnable_outside(100, tmp_path) == 2, "the two runnable threads of process 200"
    assert fidelity.runnable_outside(101, tmp_path) == 3, "process 100 is outside 101's tree"
    with fidelity.OtherWork(every_s=0.01, proc=tmp_path) as other:
        pass
    assert other.mean == 6, "this process is not among them: every runnable task is other work"
