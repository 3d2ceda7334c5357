"""``benchmarks/core_sharing.py``: two ranks' worth of a held-out model's own step on the host's cores,
against the profiler's matmul figure (``docs/performance.md``)."""

from __future__ import annotations

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]


def _core_sharing() -> SimpleNamespace:
    """benchmarks/core_sharing.py's functions (a script, not a package)."""
    return SimpleNamespace(**runpy.run_path(str(REPO / "benchmarks" / "core_sharing.py"), run_name="core_sharing"))


def test_a_turns_sharing_is_the_slower_rank_together_over_both_alone() -> None:
    bench = _core_sharing()
    turn = bench.Turn(alone=(20.0, 30.0), together=(27.0, 30.0), matmul=1.1)
    assert turn.sharing == pytest.approx(30.0 / 25.0), "a synchronous stage waits for its slower rank"


def test_stolen_time_is_read_from_the_kernels_cpu_line(tmp_path: Path) -> None:
    bench = _core_sharing()
    stat = tmp_path / "stat"
    stat.write_text("cpu  2347911 51 262839 1803448 7291 0 17019 1039 0 0\ncpu0 945317 33 113193 1149399 0 0 0 5 0 0\n")
    assert bench.steal_jiffies(stat) == 1039
    stat.write_text("intr 1 2 3\n")
    assert bench.steal_jiffies(stat) is None, "a file without the cpu line reads as unknown"
    assert bench.steal_jiffies(tmp_path / "missing") is None


@pytest.mark.slow
@pytest.mark.heavy
def test_the_benchmark_times_a_held_out_model_alone_and_together(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "core_sharing.py"), "--models", "hf_resnet", "--turns", "2",
         "--steps", "2"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600,
        check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    row = next(line for line in done.stdout.splitlines() if "hf_resnet" in line and "of 2" in line)
    cells = [cell.strip() for cell in row.split("│")[1:-1]]
    alone, together, sharing = float(cells[1]), float(cells[2]), float(cells[3].split()[0])
    assert alone > 0 and together > 0, row
    assert 0.5 < sharing < 4, f"two single-thread processes on this host's cores: {row}"
    assert re.fullmatch(r"\d of 2", cells[4]), row
