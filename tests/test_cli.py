"""The real `deeppool` console script: the main job works, user mistakes get one line and exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "models" / "tiny_mlp.py")


SCRIPT = Path(sys.executable).parent / "deeppool"


def deeppool(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """The installed console script (its entry point is what users run)."""
    command = [str(SCRIPT)] if SCRIPT.is_file() else [sys.executable, "-c", "from deeppool.cli import main; main()"]
    return subprocess.run([*command, *args], capture_output=True, text=True, cwd=cwd, timeout=300)


def test_plan_writes_plan_and_gantt(tmp_path):
    out, chart = tmp_path / "plan.json", tmp_path / "plan.png"
    result = deeppool("plan", TINY, "--gpus", "8", "--batch", "32", "--device-model", "h100",
                      "--out", str(out), "--gantt", str(chart))
    assert result.returncode == 0, result.stderr
    assert "vs data parallel" in result.stdout
    plan = json.loads(out.read_text())
    assert plan["gpus"] == 8 and plan["global_batch"] == 32 and plan["device"] == "h100"
    assert plan["predicted"]["iteration_ms"] <= plan["predicted"]["data_parallel_iteration_ms"] + 1e-9
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_measures_here_then_plans_from_the_file(tmp_path):
    profile = tmp_path / "tiny-cpu.json"
    cache = tmp_path / "cache"
    measured = deeppool("profile", TINY, "--out", str(profile), "--batches", "1,2,4", "--repeats", "2",
                        "--warmup", "1", "--cache-dir", str(cache))
    assert measured.returncode == 0, measured.stderr
    data = json.loads(profile.read_text())
    assert data["source"] == "measured" and set(data["layers"]) == {"fc1", "act", "fc2", "add", "head"}
    assert all(t > 0 for entry in data["layers"].values() for t in entry["fwd_ms"])
    planned = deeppool("plan", TINY, "--gpus", "4", "--batch", "4", "--profile", str(profile),
                       "--out", str(tmp_path / "p.json"))
    assert planned.returncode == 0, planned.stderr
    assert json.loads((tmp_path / "p.json").read_text())["device"] == data["device"]


def test_factory_form_with_input_shape(tmp_path):
    result = deeppool("plan", "tests.models.factories:small_cnn", "--input-shape", "3,8,8", "--gpus", "4",
                      "--batch", "16", "--device-model", "a100", "--out", str(tmp_path / "p.json"))
    assert result.returncode == 0, result.stderr
    model = json.loads((tmp_path / "p.json").read_text())["model"]
    assert model == {"source": "factory", "location": "tests.models.factories:small_cnn",
                     "input_shape": [3, 8, 8], "input_dtype": "float32", "vocab_size": 0, "seed": 0}


def test_factory_with_token_inputs(tmp_path):
    result = deeppool("plan", "tests.models.token_factory:tiny_lm", "--input-shape", "16", "--input-dtype", "int64",
                      "--vocab-size", "64", "--gpus", "2", "--batch", "4", "--device-model", "a100",
                      "--out", str(tmp_path / "p.json"))
    assert result.returncode == 0, result.stderr
    model = json.loads((tmp_path / "p.json").read_text())["model"]
    assert (model["input_dtype"], model["vocab_size"]) == ("int64", 64)


@pytest.fixture(scope="module")
def wrong_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wrong")
    (folder / "corrupt.json").write_text('{"schema_version": 1')
    (folder / "old.json").write_text(json.dumps({"artifact": "profile", "schema_version": 0}))
    return folder


BAD_INPUTS = {
    "missing file": (["plan", "nope.py", "--gpus", "2"], "does not exist"),
    "no inputs()": (["plan", str(ROOT / "tests/models/no_inputs.py"), "--gpus", "2"], "defines no inputs()"),
    "bad import": (["plan", "no.such.module:make", "--input-shape", "3", "--gpus", "2"], "cannot import"),
    "untraceable": (["plan", str(ROOT / "tests/models/untraceable.py"), "--gpus", "2", "--device-model", "a100"],
                    "cannot trace module 'gate'"),
    "gpus < 1": (["plan", TINY, "--gpus", "0"], "--gpus 0"),
    "batch < 1": (["plan", TINY, "--gpus", "2", "--batch", "0"], "--batch 0"),
    "unknown device": (["plan", TINY, "--gpus", "2", "--device-model", "tpu9"], "unknown device model 'tpu9'"),
    "infeasible amplification": (["plan", TINY, "--gpus", "2", "--amplification", "0.5"], "below 1"),
    "corrupted profile": (["plan", TINY, "--gpus", "2", "--profile", "{folder}/corrupt.json"], "not valid JSON"),
    "wrong version": (["plan", TINY, "--gpus", "2", "--profile", "{folder}/old.json"], "schema_version 0"),
    "token ids without a vocabulary": (["plan", "tests.models.token_factory:tiny_lm", "--input-shape", "16",
                                        "--input-dtype", "int64", "--gpus", "2"], "--vocab-size"),
    "unknown input dtype": (["plan", "tests.models.factories:small_cnn", "--input-shape", "3,8,8",
                             "--input-dtype", "float99", "--gpus", "2"], "--input-dtype 'float99'"),
}


def test_bad_input_is_one_line_exit_2_no_traceback(wrong_files):
    cases = {
        name: [arg.format(folder=wrong_files) for arg in args] for name, (args, _) in BAD_INPUTS.items()
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(cases, pool.map(lambda args: deeppool(*args), cases.values()), strict=True))
    for name, result in results.items():
        expected = BAD_INPUTS[name][1]
        assert result.returncode == 2, f"{name}: {result.stderr}"
        assert "Traceback" not in result.stderr, name
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], f"{name}: {lines}"


def test_memory_infeasible_names_the_layer(tmp_path):
    profile = tmp_path / "small-device.json"
    assert deeppool("profile", TINY, "--out", str(profile), "--batches", "1,2", "--repeats", "1",
                    "--cache-dir", str(tmp_path)).returncode == 0
    data = json.loads(profile.read_text())
    data["memory_bytes"] = 1000
    profile.write_text(json.dumps(data))
    result = deeppool("plan", TINY, "--gpus", "2", "--batch", "2", "--profile", str(profile))
    assert result.returncode == 2
    assert "infeasible" in result.stderr and "layer 'fc1'" in result.stderr
