"""Issue 23: a held-out model (not in benchmarks/models, which the cost model was tuned on), planned and run
with the default flags through ``benchmarks/fidelity.py --zoo``: every per-GPU batch the plan uses is
measured, and on a quiet machine (load ≤ 2) the run's iteration is within ±15% of the prediction."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROW = re.compile(r"measured/predicted (?P<ratio>[\d.]+).*load (?P<before>[\d.]+) → (?P<after>[\d.]+)")


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
    load = max(float(found["before"]), float(found["after"]))
    if load > 2:
        pytest.skip(f"load {load:.1f} > 2: the ±15% goal holds on a quiet machine (row: {rows[0]})")
    assert abs(float(found["ratio"]) - 1) <= 0.15, rows[0]
