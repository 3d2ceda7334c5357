"""``deeppool plan --batch auto``: the planner's own iteration times at every candidate batch, goodput-optimal choice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deeppool.adaptation.goodput import statistical_efficiency
from deeppool.plans import ModelSpec, Plan
from deeppool.planner.api import CostSource, PlanRequest, batch_planner
from deeppool.planner.batch_search import BatchSearchRequest, search_batches
from tests.entry import deeppool

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "tests" / "models" / "tiny_mlp.py")


@pytest.fixture(scope="module")
def solve():
    """Real ILP plans of the tiny MLP on 4 estimated H100s, one traced graph for every batch."""
    return batch_planner(ModelSpec.parse(TINY), PlanRequest(gpus=4, global_batch=4), CostSource(device_model="h100"))


def test_default_candidates_are_doublings_from_the_gpu_count() -> None:
    assert BatchSearchRequest(gpus=6, noise_scale=10).candidates() == (8, 16, 32, 64, 128, 256, 512, 1024)
    assert BatchSearchRequest(gpus=2, noise_scale=10, base_batch=100).candidates()[:2] == (128, 256)
    assert BatchSearchRequest(gpus=2, noise_scale=10, batches=(64, 16)).candidates() == (16, 64)


def test_the_chosen_plan_has_the_best_goodput_of_the_planned_iteration_times(solve) -> None:
    planned, result = search_batches(solve, BatchSearchRequest(gpus=4, noise_scale=500, batches=(4, 16, 64, 256)))
    goodputs = {}
    for batch in (4, 16, 64, 256):
        seconds = solve(batch).plan.predicted.iteration_ms / 1e3  # the same ILP, solved again
        goodputs[batch] = batch / seconds * statistical_efficiency(batch, base_batch=4, noise_scale=500)
    assert [c.batch for c in result.choices] == [4, 16, 64, 256]
    assert [c.goodput for c in result.choices] == pytest.approx(list(goodputs.values()), rel=1e-6)
    assert planned.plan.global_batch == result.chosen.batch == max(goodputs, key=goodputs.get)
    assert planned.plan.goodput == result
    assert all(1 <= c.gpus <= 4 for c in result.choices)


def test_a_larger_noise_scale_never_picks_a_smaller_batch(solve) -> None:
    chosen = [search_batches(solve, BatchSearchRequest(gpus=4, noise_scale=phi, batches=(4, 16, 64, 256, 1024)))[1]
              .chosen.batch for phi in (1, 100, 10_000, 1e7)]
    assert chosen == sorted(chosen)
    assert chosen[0] < chosen[-1]


def test_cli_writes_the_optimal_plan_the_table_and_the_plot(capsys, tmp_path) -> None:
    out, png = tmp_path / "plan.json", tmp_path / "goodput.png"
    result = deeppool(capsys, "plan", TINY, "--gpus", "4", "--batch", "auto", "--gns", "300", "--batches",
                      "4,16,64,256", "--device-model", "h100", "--out", str(out), "--goodput-plot", str(png))
    assert result.code == 0, result.stderr
    assert "goodput per global batch" in result.stdout and "best goodput at global batch" in result.stdout
    saved = json.loads(out.read_text())
    assert saved["global_batch"] == saved["goodput"]["chosen_batch"]
    assert len(saved["goodput"]["choices"]) == 4
    assert Plan.load(out).goodput.chosen.batch == saved["global_batch"]
    assert png.read_bytes().startswith(b"\x89PNG")
