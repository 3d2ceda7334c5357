"""``deeppool replay`` end to end: four jobs of a Pollux workload on a real coordinator (2 CPU slots), then in the
simulator with the speeds they measured."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from deeppool.cluster_sim.models import load_mapping
from deeppool.cluster_sim.shipped import resolve
from deeppool.cluster_sim.workload import read_workload
from deeppool.coordinator.client import Client
from deeppool.coordinator.store import Store
from deeppool.replay.report import JSON_FILE, PICTURE_FILE, replay, write
from deeppool.replay.slicing import SliceSettings, scale
from tests.coordinator.test_durability import start
from tests.net import free_port

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # about 2 minutes on 2 busy cores: job start-up dominates
REPO = Path(__file__).resolve().parents[2]
MAPPING = REPO / "benchmarks" / "replay_models" / "mapping.json"
GOAL = 0.15
NOMINAL_STEP_S = 0.2
"""What sizes the jobs here (20 steps for 4 s): the simulator gets the speeds the jobs measure."""
"""The issue's bound on average JCT and makespan, simulated against live."""


def test_a_replayed_slice_runs_live_and_its_simulation_agrees(tmp_path: Path) -> None:
    db, port = tmp_path / "deeppool.db", free_port()
    token = Store(db).create_token("alice")
    server = start(db, port, gpus=2, allow=(REPO,))
    try:
        client = Client(f"http://127.0.0.1:{port}", token)
        settings = SliceSettings(slots=2, first=0, jobs=4, span_s=12.0, min_run_s=2.0, max_run_s=4.0)
        cut = scale(read_workload(resolve("workload-6")), settings, load_mapping(MAPPING),
                    lambda model, gpus: NOMINAL_STEP_S)
        result = replay(cut, client, "fifo-backfill", timeout_s=600, say=lambda line: print(line, file=sys.stderr))
        written = write(result, tmp_path / "out")
    finally:
        server.terminate()
        server.wait(10)
    live = {record.job.name: record for record in result.live.records}
    assert sorted(live) == sorted(job.name for job in cut.jobs)
    for job in cut.jobs:  # submitted on the compressed schedule, and held their slots after it
        assert live[job.name].submitted_s == pytest.approx(job.arrival_s, abs=2.0)
        assert live[job.name].started_s >= live[job.name].submitted_s
    comparison = result.comparison
    assert comparison.steps_only.makespan_s < comparison.simulated.makespan_s  # start-up is measured, not zero
    assert abs(comparison.jct_gap) <= GOAL and abs(comparison.makespan_gap) <= GOAL, comparison
    assert [path.name for path in written] == [JSON_FILE, PICTURE_FILE]
    saved = json.loads(written[0].read_text())
    assert len(saved["live"]) == len(saved["simulated"]) == 4 and saved["policy"] == "fifo-backfill"
