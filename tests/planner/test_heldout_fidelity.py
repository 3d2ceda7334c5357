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
         "--models", "mobilenet_small", "--steps", "12", "--replay", "--scatter", str(tmp_path / "zoo.png")],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=1200,
        check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("run 1  mobilenet_small")]
    assert len(rows) == 1 and "stages measured/predicted" in rows[0], done.stdout
    assert (tmp_path / "zoo.png").read_bytes().startswith(b"\x89PNG")
    replays = [line for line in done.stdout.splitlines() if line.startswith("replay of run 1  mobilenet_small")]
    assert len(replays) == 1 and "ms now" in replays[0], done.stdout
    assert "the same plan run twice" in done.stdout and "at the replay" in done.stdout
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


def _row(fidelity: SimpleNamespace, run: int, predicted: float, measured: float, replayed: float):
    return fidelity.ZooRow(run=run, model="m", nproc=2, counts=(2,), predicted_ms=predicted, measured_ms=measured,
                           uncertainty=0.05, busy_layers=0, stages=(), spreads=(), load_before=1.0, load_after=1.0,
                           other_work=0.0, reference_before=6.0, reference_after=6.0, shared=2, sharing_planned=1.0,
                           sharing_run=1.0, replayed_ms=replayed)


def test_a_replay_tells_a_run_that_moved_from_a_prediction_that_did():
    """Run 1's plan predicted low and its run held at the replay (the prediction moved); run 2's run moved."""
    fidelity = _fidelity()
    rows = [_row(fidelity, 1, 30.0, 36.0, 36.0), _row(fidelity, 2, 35.0, 36.0, 42.0)]
    assert [row.drift for row in rows] == [1.0, pytest.approx(42 / 36)]
    summary = fidelity.drift_summary(rows).splitlines()
    assert summary[0].endswith("median 8%, largest 17%, above 15% in 1 of 2")
    assert summary[1].endswith("median 17%, largest 17%, above 15% in 1 of 1")
    assert summary[2].endswith("median 17%, largest 17%, above 15% in 1 of 1")
    assert summary[3] == "rows within ±15%: 1 of 2 at their run, 0 of 2 at the replay"
    assert "(miss)" in rows[1].replay_line() and "1.17x" in rows[1].replay_line()
