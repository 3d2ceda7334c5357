"""The shipped traces: found by name from any folder, listed, and an unknown name is one error line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from deeppool.cluster_sim.shipped import PHILLY, POLLUX, resolve, shipped
from deeppool.cluster_sim.workload import TraceFormat, read_workload

REPO = Path(__file__).resolve().parents[2]


def test_names_resolve_to_the_files_in_the_package(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve("philly") == PHILLY
    assert resolve("workload-6") == POLLUX / "workloads" / "workload-6.csv"
    assert resolve("workloads-2.0/workload-6.csv") == POLLUX / "workloads-2.0" / "workload-6.csv"
    assert read_workload(resolve("workload-6")).format is TraceFormat.POLLUX
    assert len(shipped()) == 33 and shipped()[0].jobs == 82_247


def test_a_file_of_that_name_here_wins(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "philly").write_text("mine")
    assert resolve("philly") == Path("philly")


def test_simulate_lists_the_traces_and_refuses_an_unknown_name(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    listed = subprocess.run([sys.executable, "-m", "deeppool.cli", "simulate", "--list-traces"], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert listed.returncode == 0 and listed.stdout.splitlines()[0].split()[:3] == ["philly", "82,247", "jobs"]
    assert "workloads-2.0/workload-6" in listed.stdout and "CC-BY-4.0" in listed.stdout
    refused = subprocess.run([sys.executable, "-m", "deeppool.cli", "simulate", "workload-9", "--gpus", "8", "--out",
                              "out"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stderr.startswith("error: trace file 'workload-9' does not exist")
    assert len(refused.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
