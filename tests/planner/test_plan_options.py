"""The cost-model options of `deeppool plan` through the real entry point: mistakes are one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.entry import deeppool

TINY = str(Path(__file__).resolve().parents[1] / "models" / "tiny_mlp.py")
A100 = ["plan", TINY, "--gpus", "2", "--device-model", "a100"]

MISTAKES = [
    ("trade-off without a price", [*A100, "--objective", "time+gpu-time"], "--price"),
    ("negative price", [*A100, "--price", "-1"], "--price"),
    ("unknown objective", [*A100, "--objective", "cost"], "--objective"),
    ("unknown precision", [*A100, "--precision", "fp8"], "--precision"),
    ("precision with local measuring", ["plan", TINY, "--gpus", "2", "--precision", "bf16"], "--precision"),
    ("negative bucket", [*A100, "--bucket-mb", "-1"], "--bucket-mb"),
    ("pareto in an unknown format", [*A100, "--pareto", "front.xyz"], "--pareto"),
    ("cross-node faster than in-node", [*A100, "--inter-gbps", "500"], "cross-node"),
]


@pytest.mark.parametrize(("case", "args", "named"), MISTAKES, ids=[case for case, _, _ in MISTAKES])
def test_a_cost_model_mistake_is_one_line_exit_2(capsys, tmp_path, monkeypatch, case, args, named):
    monkeypatch.chdir(tmp_path)
    result = deeppool(capsys, *args)
    lines = result.stderr.strip().splitlines()
    assert result.code == 2 and "Traceback" not in result.stderr, result
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], lines
    assert list(tmp_path.iterdir()) == []


def test_plan_writes_the_best_data_parallel_keys_and_a_pareto_front(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = deeppool(capsys, *A100, "--batch", "8", "--out", "p.json", "--pareto", "front.png",
                      "--precision", "bf16")
    assert result.code == 0, result
    assert "vs data parallel at its best width" in result.stdout and (tmp_path / "front.png").stat().st_size > 0
    predicted = json.loads((tmp_path / "p.json").read_text())["predicted"]
    assert {"best_data_parallel_gpus", "best_data_parallel_iteration_ms", "speedup_vs_best_data_parallel"} <= set(predicted)
    assert predicted["iteration_ms"] <= predicted["best_data_parallel_iteration_ms"] + 1e-9
