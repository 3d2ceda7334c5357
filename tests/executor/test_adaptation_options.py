"""The adaptation options of `deeppool run` and `deeppool plan`: the plan records the combine choice,
bad combinations are refused in one line, and a run over the command line reports the noise scale."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from deeppool.errors import DeeppoolError
from deeppool.executor.config import Adaptation, LrScaling, Monitor
from deeppool.plans import Combine, Plan
from tests.entry import deeppool
from tests.executor.plans import cycle, make_plan, model_path
from tests.executor.test_executor_processes import deeppool_run

GROUPED = make_plan("noisy_quadratic", global_batch=16, gpus=2, assign=cycle(2))
ALONE = make_plan("noisy_quadratic", global_batch=16, gpus=2, assign=lambda i, layer: 1 if layer.name.startswith("add") else 2)


def test_the_plan_records_the_combine_choice_and_older_plans_read_as_sum(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    dataclasses.replace(GROUPED, combine=Combine.ADASUM).save(path)
    assert json.loads(path.read_text())["combine"] == "adasum"
    assert Plan.load(path).combine is Combine.ADASUM
    older = {key: value for key, value in GROUPED.to_json().items() if key != "combine"}
    path.write_text(json.dumps(older))
    assert Plan.load(path).combine is Combine.SUM


def test_deeppool_plan_writes_combine(tmp_path: Path, capsys) -> None:
    out = tmp_path / "plan.json"
    planned = deeppool(capsys, "plan", model_path("mlp"), "--gpus", "2", "--batch", "6", "--device-model", "a100",
                       "--combine", "adasum", "--out", str(out))
    assert planned.code == 0, planned.stderr
    assert Plan.load(out).combine is Combine.ADASUM
    refused = deeppool(capsys, "plan", model_path("mlp"), "--gpus", "2", "--device-model", "a100", "--combine", "mean",
                       "--out", str(tmp_path / "other.json"))
    assert refused.code == 2 and refused.stderr.strip() == "error: --combine 'mean' is not one of sum, adasum"


@pytest.mark.parametrize(("plan", "args", "message"), [
    (ALONE, ("--monitor", "gns"), "--monitor gns compares gradients before and after a layer group's all-reduce"),
    (ALONE, ("--lr-scaling", "adascale"), "--lr-scaling adascale compares gradients"),
    (GROUPED, ("--combine", "adasum", "--monitor", "gns"), "--combine adasum does not give the mean gradient"),
    (GROUPED, ("--base-batch", "4"), "--base-batch sets AdaScale's base batch"),
    (GROUPED, ("--lr-scaling", "adascale", "--base-batch", "0"), "--base-batch 0 must be at least 1"),
    (GROUPED, ("--lr-scaling", "adascale", "--base-batch", "40", "--accumulate", "2"),
     "--base-batch 40 is more than a step's batch of 32 samples"),
    (GROUPED, ("--lr-scaling", "adascale", "--check"), "--check compares with plain training"),
    (dataclasses.replace(GROUPED, combine=Combine.ADASUM), ("--check",), "the plan combines gradients with Adasum"),
    (dataclasses.replace(GROUPED, combine=Combine.ADASUM), ("--monitor", "gns"), "the plan combines gradients with"),
    (GROUPED, ("--batch", "40"), "--batch 40 is not a multiple of the plan's global batch 16: give a multiple "
                                 "(e.g. --batch 32), or re-plan with --batch 40"),
    (GROUPED, ("--batch", "32", "--accumulate", "2"), "--batch 32 sets the micro-batches per step: drop --accumulate 2"),
    (GROUPED, ("--monitor", "gns", "--precision", "fp16"), "--monitor gns and --lr-scaling adascale measure unscaled"),
    (GROUPED, ("--optimizer", "kfac", "--combine", "adasum"), "--optimizer kfac preconditions the mean gradient"),
    (GROUPED, ("--optimizer", "kfac", "--kfac-factor-decay", "1"), "--kfac-factor-decay 1.0 must be in [0, 1)"),
], ids=["gns-alone", "adascale-alone", "adasum-gns", "base-without-adascale", "base-0", "base-too-large",
        "adascale-check", "plan-adasum-check", "plan-adasum-gns", "batch-not-multiple", "batch-and-accumulate",
        "gns-fp16", "kfac-adasum", "kfac-decay"])
def test_bad_combinations_are_refused_in_one_line(tmp_path: Path, capsys, plan: Plan, args: tuple[str, ...],
                                                  message: str) -> None:
    path = tmp_path / "plan.json"
    plan.save(path)
    proc, _ = deeppool_run(capsys, path, "--out", str(tmp_path / "out"), *args)
    assert proc.code == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr


def test_adaptation_settings_are_checked_at_construction() -> None:
    assert Adaptation(lr_scaling=LrScaling.ADASCALE).measures and Adaptation(monitor=Monitor.GNS).measures
    assert not Adaptation(combine=Combine.ADASUM).measures
    with pytest.raises(DeeppoolError, match="--base-batch 0"):
        Adaptation(lr_scaling=LrScaling.ADASCALE, base_batch=0)


@pytest.mark.slow
def test_a_run_reports_the_noise_scale_and_tau_in_its_summary_output_and_trace(tmp_path: Path, capfd) -> None:
    path, out = tmp_path / "plan.json", tmp_path / "out"
    GROUPED.save(path)
    proc, _ = deeppool_run(capfd, path, "--nproc", "2", "--steps", "4", "--monitor", "gns", "--lr-scaling", "adascale",
                           "--batch", "32", "--base-batch", "2", "--out", str(out))
    assert proc.code == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["gns"] > 0 and summary["gns_stats"]["groups"] == 1 and summary["gns_stats"]["skipped"] == 0
    assert summary["adascale"]["batch"] == 32 and summary["adascale"]["scale"] == 16  # --batch: 2 micro-batches
    assert summary["adascale"]["tau"] >= 4
    assert "gradient noise scale: " in proc.stdout and "AdaScale: tau " in proc.stdout
    counters = [e for e in json.loads((out / "trace-rank0.json").read_text())["traceEvents"] if e["ph"] == "C"]
    assert [e["name"] for e in counters] == ["gns", "adascale"] * 4
    assert counters[-2]["args"]["noise_scale"] == pytest.approx(summary["gns"])
