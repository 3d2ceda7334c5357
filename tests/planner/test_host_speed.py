"""``benchmarks/host_speed.py``: which reading of the host's speed carries a step measured at one time to
another (``docs/performance.md``)."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]


def _host_speed() -> SimpleNamespace:
    """benchmarks/host_speed.py's functions (a script, not a package)."""
    return SimpleNamespace(**runpy.run_path(str(REPO / "benchmarks" / "host_speed.py"), run_name="host_speed"))


def _samples(bench: SimpleNamespace) -> list:
    """A host whose speed halves for the second half of the minutes: the memory reading follows it, the
    reference work does not."""
    return [bench.Sample(at_s=float(t), core=t % 2, reference_ms=6.0, memory_ms=10.0 * (2 if t >= 100 else 1),
                         step_ms=20.0 * (2 if t >= 100 else 1)) for t in range(200)]


def test_a_reading_that_follows_the_step_carries_every_pair_and_one_that_does_not_only_the_steady_ones() -> None:
    bench = _host_speed()
    samples = _samples(bench)
    unscaled = bench.carried(samples, None, apart_s=10.0)
    assert bench.carried(samples, lambda s: s.memory_ms, apart_s=10.0) == 1.0
    assert bench.carried(samples, lambda s: s.reference_ms, apart_s=10.0) == pytest.approx(unscaled)
    assert 0.3 < unscaled < 0.7, "pairs across the change miss, pairs on one side of it hold"
    assert bench.carried(samples, None, apart_s=1000.0) != bench.carried(samples, None, apart_s=1000.0), "no pair: NaN"


def test_the_core_table_counts_slow_steps_per_core() -> None:
    bench = _host_speed()
    samples = _samples(bench)[:150]  # 100 at 20 ms, 50 at 40: the median is 20, 50 are slow
    table = bench.cores_table(samples)
    assert [list(column.cells) for column in table.columns][3] == ["25", "25"]


@pytest.mark.slow
@pytest.mark.heavy
def test_the_benchmark_samples_a_held_out_model_and_draws_the_series(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "host_speed.py"), "--model", "hf_resnet", "--batch", "4",
         "--minutes", "0.1", "--apart-s", "1", "--plot", str(tmp_path / "speed.png")],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600,
        check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split("│")[1].strip(): line for line in done.stdout.splitlines() if line.count("│") > 4}
    assert {"none (baseline)", "reference work (ms)", "64 MiB copy (ms)", "the step itself (ms)"} <= set(rows)
    assert "100%" in rows["the step itself (ms)"], "the step carries itself exactly"
    assert (tmp_path / "speed.png").stat().st_size > 10_000
