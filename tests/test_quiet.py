"""Quiet by default: no solver banner in a plan's output; ``deeppool --verbose`` shows it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PLAN = ["plan", "tests.models.factories:small_cnn", "--input-shape", "3,32,32", "--gpus", "4", "--batch", "64",
        "--device-model", "a100", "--solver", "highs"]


def plan(tmp_path: Path, *flags: str, out: str) -> subprocess.CompletedProcess[str]:
    env = {key: value for key, value in os.environ.items() if key != "DEEPPOOL_VERBOSE"}
    return subprocess.run([sys.executable, "-m", "deeppool.cli", *flags, *PLAN, "--out", out], cwd=tmp_path,
                          env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)


def test_the_solver_banner_shows_only_with_verbose(tmp_path: Path) -> None:
    quiet = plan(tmp_path, out="quiet.json")
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.startswith("ilp plan: 4 GPUs") and "HiGHS" not in quiet.stdout + quiet.stderr
    verbose = plan(tmp_path, "--verbose", out="verbose.json")
    assert verbose.returncode == 0 and "Running HiGHS" in verbose.stdout
