"""The zoo end to end: models written the way public zoos write them plan and train unchanged.

Every file under ``tests/models/zoo/`` is planned through the CLI's entry point (in this process), then
run for real on gloo ranks with a hand-made burst plan (at least two distinct
GPU counts) and ``--check`` against one process. The files under
``tests/models/zoo/refused/`` must be refused up front: exit 2, one line
``error: ...`` naming the module at fault, no traceback.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.entry import Result, deeppool
from tests.executor.plans import Assign, cycle, make_plan_for

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "tests" / "models" / "zoo"
REFUSED = ZOO / "refused"

# file stem -> (global batch, ranks, GPU counts cycled over the layers)
RUNS: dict[str, tuple[int, int, Assign]] = {
    "hf_gpt2": (8, 2, cycle(2, 1)),
    "hf_bert": (8, 2, cycle(2, 1)),
    "hf_t5": (8, 4, cycle(4, 2, 1, 3)),
    "hf_vit": (8, 4, cycle(4, 2, 1, 3)),
    "hf_llama": (8, 4, cycle(4, 2, 1, 3)),
    "hf_gpt_neox": (8, 4, cycle(4, 2, 1, 3)),
    "hf_bart": (8, 4, cycle(4, 2, 1, 3)),
    "hf_whisper": (8, 4, cycle(4, 2, 1, 3)),
    "hf_convnext": (8, 4, cycle(4, 2, 1, 3)),
    "hf_swin": (8, 4, cycle(4, 2, 1, 3)),
    "hf_regnet": (8, 4, cycle(4, 2, 1, 3)),
    "tv_regnet": (8, 4, cycle(4, 2, 1, 3)),
    "layerdrop_zero": (8, 4, cycle(4, 2, 1, 3)),
    "tv_resnet": (8, 4, cycle(4, 2, 1, 3)),
    "tv_mobilenet": (8, 2, cycle(2, 1)),
    "tv_inception": (8, 2, cycle(2, 1)),
    "tv_densenet": (8, 2, cycle(2, 1)),
    "attn_shapes": (8, 4, cycle(4, 2, 1, 3)),
}


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"zoo_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_zoo_file_is_run() -> None:
    assert {p.stem for p in ZOO.glob("*.py")} - {"__init__"} == set(RUNS)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_zoo_file_runs_eagerly(name: str) -> None:
    """The model itself is fine: deterministic inputs batched on dim 0, a scalar loss, gradients."""
    module = load(ZOO / f"{name}.py")
    net, batch = module.model(), module.inputs(3)
    tensors = list(batch.values()) if isinstance(batch, dict) else list(batch)
    assert all(t.shape[0] == 3 for t in tensors)
    again = module.inputs(3)
    assert all(torch.equal(a, b) for a, b in zip(tensors, again.values() if isinstance(again, dict) else again))
    output = net(**batch) if isinstance(batch, dict) else net(*batch)
    if hasattr(module, "loss"):
        loss = module.loss(output, module.targets(3) if hasattr(module, "targets") else None)
    else:
        loss = output.loss  # the model's own loss, computed from `labels`
    assert loss.dim() == 0
    loss.backward()
    assert any(p.grad is not None for p in net.parameters())


HEAVY = {"hf_bart", "hf_whisper", "hf_t5", "hf_gpt_neox", "hf_convnext", "hf_swin", "hf_regnet"}
"""The zoo's slowest burst runs (1-5 min each on 2 cores): in the heavy tier, not the default test run."""


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.heavy) if n in HEAVY else n for n in sorted(RUNS)])
def test_zoo_model_plans_and_trains_burst_parallel_exactly(tmp_path: Path, capfd, name: str) -> None:
    path = ZOO / f"{name}.py"
    planned = deeppool(capfd, "plan", str(path), "--gpus", "4", "--batch", "8", "--device-model", "a100",
                       "--out", str(tmp_path / "plan.json"))
    assert planned.code == 0, planned.stderr[-3000:]
    assert len(json.loads((tmp_path / "plan.json").read_text())["layers"]) >= 2

    batch, ranks, assign = RUNS[name]
    plan = make_plan_for(path, global_batch=batch, gpus=ranks, assign=assign)
    assert len(set(plan.assignment.values())) >= 2  # a burst plan, not data parallel
    plan.save(tmp_path / "burst.json")
    out = tmp_path / "run"
    ran = deeppool(capfd, "run", str(tmp_path / "burst.json"), "--nproc", str(ranks), "--steps", "2", "--warmup", "0",
                   "--check", "--out", str(out))
    assert ran.code == 0, ran.stderr[-3000:]
    assert "max relative difference" in ran.stdout, ran.stdout[-3000:]
    assert (out / "summary.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["hf_gpt2", "tv_regnet"])
def test_zoo_model_plans_with_local_measurement(tmp_path: Path, capfd, name: str) -> None:
    """Measured here, not estimated: a dict of inputs (GPT-2) and a model that cannot be built on meta (RegNet)."""
    planned = deeppool(capfd, "plan", str(ZOO / f"{name}.py"), "--gpus", "2", "--batch", "8",
                       "--max-measured-batch", "4", "--out", str(tmp_path / "plan.json"))
    assert planned.code == 0, planned.stderr[-3000:]
    assert "Traceback" not in planned.stderr
    assert len(json.loads((tmp_path / "plan.json").read_text())["layers"]) >= 2


def assert_refused(result: Result, module: str) -> None:
    assert result.code == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"'{module}'" in lines[0], lines


@pytest.mark.slow
def test_data_dependent_control_flow_is_refused_at_plan_time(tmp_path: Path, capfd) -> None:
    result = deeppool(capfd, "plan", str(REFUSED / "data_dependent.py"), "--gpus", "4", "--batch", "8",
                      "--device-model", "a100", "--out", str(tmp_path / "plan.json"))
    assert_refused(result, "gate")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "words"), [
    ("layerdrop", ("layerdrop.py:", "if torch.rand([]) < self.layerdrop", "set its probability to 0")),
    ("running_mean", ("'norm.mean'", "from the batch's values")),
])
def test_model_is_refused_at_plan_time_naming_the_line_or_buffer(
    tmp_path: Path, capfd, name: str, words: tuple[str, ...]
) -> None:
    result = deeppool(capfd, "plan", str(REFUSED / f"{name}.py"), "--gpus", "4", "--batch", "8",
                      "--device-model", "a100", "--out", str(tmp_path / "plan.json"))
    assert result.code == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, lines
    assert all(word in lines[0] for word in words), lines[0]
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.slow
def test_batch_mixing_is_refused_before_training(tmp_path: Path, capfd) -> None:
    make_plan_for(REFUSED / "batch_mixing.py", global_batch=8, gpus=2, assign=cycle(2, 1)).save(tmp_path / "p.json")
    result = deeppool(capfd, "run", str(tmp_path / "p.json"), "--nproc", "2", "--steps", "2", "--warmup", "0",
                      "--out", str(tmp_path / "run"))
    assert_refused(result, "center")
