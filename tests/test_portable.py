"""Plans that run anywhere: model paths relative to the plan file, a --model override, and plans made
from Python that either record how to rebuild the model or run with the module itself."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import deeppool
from deeppool.errors import DeeppoolError
from deeppool.executor.config import RunConfig
from deeppool.model.loading import load_model
from deeppool.plans import ModelSource, Plan
from tests import entry

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "tests" / "models"


def deeppool_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    result = entry.deeppool(capsys, *args)
    return result.code, result.stderr


@pytest.fixture
def moved_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """A plan and its model file planned in one folder, then moved together to another."""
    first = tmp_path / "first"
    (first / "models").mkdir(parents=True)
    shutil.copy(MODELS / "tiny_mlp.py", first / "models" / "tiny.py")
    out = first / "plans" / "tiny-plan.json"
    code, err = deeppool_cli(capsys, "plan", str(first / "models" / "tiny.py"), "--gpus", "2", "--batch", "8",
                             "--device-model", "a100", "--out", str(out))
    assert code == 0, err
    assert json.loads(out.read_text())["model"]["location"] == "../models/tiny.py"
    shutil.move(first, tmp_path / "second")
    return tmp_path / "second" / "plans" / "tiny-plan.json"


def test_a_plan_moves_with_its_model_file(moved_plan: Path) -> None:
    spec = Plan.load(moved_plan).model
    assert Path(spec.location) == moved_plan.parent.parent / "models" / "tiny.py"
    assert type(load_model(spec).module).__name__ == "TinyResidual"


def test_run_refuses_a_missing_model_and_names_model_flag(moved_plan: Path, capsys, monkeypatch) -> None:
    (moved_plan.parent.parent / "models" / "tiny.py").unlink()
    monkeypatch.chdir(moved_plan.parent)
    code, err = deeppool_cli(capsys, "run", str(moved_plan), "--out", "run")
    assert code == 2 and err.startswith("error: ") and "give --model" in err
    assert not (moved_plan.parent / "run").exists()


def _ran(capsys: pytest.CaptureFixture[str], plan: Path, out: Path, *args: str) -> dict:
    """``deeppool run PLAN ARGS --steps 2`` on real ranks: the run's summary, after checking it trained."""
    code, err = deeppool_cli(capsys, "run", str(plan), *args, "--steps", "2", "--out", str(out))
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and len(summary["losses"]) == 2
    assert all(loss == loss and 0 < loss < 1e6 for loss in summary["losses"])  # finite, positive losses
    return summary


@pytest.mark.slow
def test_run_model_override_replaces_the_plans_model(moved_plan: Path, tmp_path: Path, capsys) -> None:
    _ran(capsys, moved_plan, tmp_path / "run", "--model", str(MODELS / "tiny_mlp.py"))
    assert Path(Plan.load(tmp_path / "run" / "plan.json").model.location) == MODELS / "tiny_mlp.py"


@pytest.mark.slow
def test_a_python_plan_runs_with_a_model_file_named_on_the_command_line(tmp_path: Path, capsys) -> None:
    from deeppool import run_command

    found = importlib.util.spec_from_file_location("tiny_elsewhere", MODELS / "tiny_mlp.py")
    assert found is not None and found.loader is not None
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)  # the file's model, built in Python: the plan cannot rebuild it alone
    plan = deeppool.plan(module.model(), module.inputs(8), gpus=2)
    assert plan.model.source is ModelSource.PYTHON
    plan.save(tmp_path / "p.json")
    with pytest.raises(DeeppoolError, match="give --model"):
        run_command.run(tmp_path / "p.json", out=tmp_path / "run")
    _ran(capsys, tmp_path / "p.json", tmp_path / "run", "--model", str(MODELS / "tiny_mlp.py"))
    assert Plan.load(tmp_path / "run" / "plan.json").model.source is ModelSource.FILE


def test_a_factory_plan_loads_from_any_folder(tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "f.json"
    code, err = deeppool_cli(capsys, "plan", "tests.models.factories:small_cnn", "--input-shape", "3,8,8",
                             "--gpus", "2", "--batch", "8", "--device-model", "a100", "--out", str(out))
    assert code == 0, err
    script = (f"from deeppool.model.loading import load_model\nfrom deeppool.plans import Plan\n"
              f"print(type(load_model(Plan.load({str(out)!r}).model).module).__name__)")
    elsewhere = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                               timeout=120)
    assert elsewhere.stdout.strip() == "Sequential", elsewhere.stderr


def test_bare_tensor_inputs_are_the_one_argument(tmp_path: Path, capsys) -> None:
    from deeppool.plans import ModelSpec

    loaded = load_model(ModelSpec.parse(str(MODELS / "bare_inputs.py")))
    (given,) = loaded.inputs(3)
    assert given.shape == (3, 8)
    code, err = deeppool_cli(capsys, "plan", str(MODELS / "bare_inputs.py"), "--gpus", "2", "--batch", "4",
                             "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "p.json"))
    assert code == 0, err  # measured here: the profiler gets the tensor as the one input


# -- plans made from Python ------------------------------------------------------------------------------------
def test_a_python_built_module_is_recorded_as_such_and_refused_by_name() -> None:
    plan = deeppool.plan(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(8, 8), gpus=2)
    assert plan.model.source is ModelSource.PYTHON and plan.model.input_shape == (8,)
    with pytest.raises(DeeppoolError, match=r"deeppool.run\(plan, model=module\)"):
        load_model(plan.model)
    with pytest.raises(DeeppoolError, match="model=module"):
        deeppool.run(plan, config=RunConfig(steps=2, warmup=0, out_dir=Path("unused")))


def test_a_class_that_rebuilds_itself_is_recorded_as_a_factory() -> None:
    from tests.models.factories import TinyNet

    plan = deeppool.plan(TinyNet(), (torch.randn(8, 8),), gpus=2)
    assert plan.model.source is ModelSource.FACTORY
    assert plan.model.location == "tests.models.factories:TinyNet"
    assert type(load_model(plan.model).module) is TinyNet


def test_a_module_from_a_file_that_does_not_import_is_not_a_factory() -> None:
    found = importlib.util.spec_from_file_location("resnet_like", MODELS / "tiny_mlp.py")
    assert found is not None and found.loader is not None
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    plan = deeppool.plan(module.model(), module.inputs(8), gpus=2)
    assert plan.model.source is ModelSource.PYTHON  # 'resnet_like:TinyResidual' would not import elsewhere


def test_a_class_defined_in_main_is_refused_before_launching(tmp_path: Path) -> None:
    plan = deeppool.plan(nn.Sequential(nn.Linear(8, 4)), torch.randn(4, 8), gpus=2)
    local = type("Local", (nn.Module,), {"__module__": "__main__", "forward": lambda self, x: x})
    with pytest.raises(DeeppoolError, match="__main__"):
        deeppool.run(plan, model=local(), config=RunConfig(steps=2, warmup=0, out_dir=tmp_path))
    assert not (tmp_path / "model.pt").exists()


def test_deeppool_run_refuses_more_ranks_than_this_machine_runs_as_the_cli_does(tmp_path: Path, capsys) -> None:
    from deeppool.executor.launch.cli import local_slots

    too_many = local_slots()[0] + 1
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    plan = deeppool.plan(module, torch.randn(too_many, 8), gpus=too_many)
    plan.save(tmp_path / "plan.json")
    out = tmp_path / "run"
    with pytest.raises(DeeppoolError, match=f"{too_many} ranks is more than this machine runs") as python:
        deeppool.run(plan, model=module, config=RunConfig(steps=2, warmup=0, out_dir=out))
    assert not out.exists()  # refused before the module was saved or a rank started
    code, err = deeppool_cli(capsys, "run", str(tmp_path / "plan.json"), "--model", "tests.models.factories:TinyNet",
                             "--out", str(tmp_path / "cli"))
    assert code == 2 and err.strip() == f"error: {python.value}"  # one check, one message


def test_deeppool_run_refuses_an_nproc_that_differs_from_the_plan(tmp_path: Path) -> None:
    module = nn.Sequential(nn.Linear(8, 4))
    plan = deeppool.plan(module, torch.randn(4, 8), gpus=2)
    with pytest.raises(DeeppoolError, match="--nproc 3 differs from the plan's 2 GPUs"):
        deeppool.run(plan, model=module, nproc=3, config=RunConfig(steps=2, warmup=0, out_dir=tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_saved_module_trains_on_the_documented_default_loss(tmp_path: Path) -> None:
    from deeppool.model.loading import default_loss, load_model
    from deeppool.multiplex.api import run

    module = nn.Sequential(nn.Linear(8, 4))
    plan = deeppool.plan(module, torch.randn(4, 8), gpus=2)
    saved = dataclasses.replace(plan.model, source=ModelSource.SAVED, location=str(tmp_path / "model.pt"))
    torch.save(module, tmp_path / "model.pt")
    loaded = load_model(saved)
    assert loaded.loss is default_loss and loaded.targets(4) is None
    output = loaded.module(*loaded.inputs(4))
    assert torch.equal(loaded.loss(output, None), output.float().square().mean())  # the mean square of the output
    assert "default_loss" in (run.__doc__ or "") and "mean square" in (run.__doc__ or "")
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert "mean square" in readme and f"`default_loss` in `{default_loss.__module__}`" in readme


@pytest.mark.slow
def test_a_python_plan_runs_with_the_module_itself(tmp_path: Path) -> None:
    module = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    plan = deeppool.plan(module, torch.randn(8, 8), gpus=2)
    summary = deeppool.run(plan, model=module, config=RunConfig(steps=3, warmup=1, out_dir=tmp_path))
    assert summary["gpus"] == 2 and summary["steps"] == 3
    assert Plan.load(tmp_path / "plan.json").model.source is ModelSource.SAVED


def test_a_model_file_names_its_builder_after_a_colon(tmp_path: Path, capsys) -> None:
    source = (MODELS / "tiny_mlp.py").read_text().replace("def model()", "def build()")
    (tmp_path / "tiny.py").write_text(source)
    out = tmp_path / "plans" / "tiny-plan.json"
    code, err = deeppool_cli(capsys, "plan", f"{tmp_path / 'tiny.py'}:build", "--gpus", "2", "--batch", "8",
                             "--device-model", "a100", "--out", str(out))
    assert code == 0, err
    model = json.loads(out.read_text())["model"]
    assert (model["source"], model["location"], model["function"]) == ("file", "../tiny.py", "build")
    assert type(load_model(Plan.load(out).model).module).__name__ == "TinyResidual"
    code, err = deeppool_cli(capsys, "plan", f"{tmp_path / 'tiny.py'}:missing", "--gpus", "2", "--batch", "8",
                             "--device-model", "a100", "--out", str(tmp_path / "other.json"))
    assert code == 2 and err.startswith("error: ") and "defines no missing() function" in err
