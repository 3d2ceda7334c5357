"""The zoo against the oldest transformers the project declares (``transformers>=4.45``), beside the newest.

The test environment has the newest; a session fixture builds a second virtual environment under the user's
cache folder with ``transformers==4.45.*`` (and the hub and tokenizers it pins) installed from the package
index, seeing this environment's torch and deeppool through a ``.pth`` file. transformers 4.x writes LayerDrop
as ``dropout_probability = torch.rand([])`` then ``if dropout_probability < self.layerdrop:``, and Bart's
``forward`` shifts labels with a slice assignment torch.fx cannot trace: with LayerDrop 0 it must plan (the
real-tensor tracer specialises the branches) and train burst parallel exactly. Heavy: it installs packages
and plans and runs Bart in a second interpreter (minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OLDEST = "4.45"
RUN_CLI = "import sys; from deeppool.cli import main; main(sys.argv[1:])"


@pytest.fixture(scope="session")
def oldest_transformers() -> Path:
    """The python of a virtual environment with transformers ``OLDEST`` over this one's packages."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deeppool-tests"
    home = cache / f"transformers-{OLDEST}"
    python = home / "bin" / "python"
    if not (home / "ready").is_file():
        venv.create(home, with_pip=True, clear=True)
        purelib = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                               text=True).strip())
        ours = sysconfig.get_paths()["purelib"]
        (purelib / "zz_deeppool_tests.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
        installed = subprocess.run([python, "-m", "pip", "install", "-q", f"transformers=={OLDEST}.*"],
                                   check=False, capture_output=True, text=True, timeout=600)
        if installed.returncode != 0:
            pytest.skip(f"cannot install transformers {OLDEST}: {installed.stderr.strip().splitlines()[-1:]}")
        (home / "ready").write_text("")
    return python


def _deeppool(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-c", RUN_CLI, *args], check=False, capture_output=True, text=True, cwd=ROOT,
                          timeout=1800)


@pytest.mark.heavy
def test_the_oldest_transformers_is_the_one_installed(oldest_transformers: Path):
    version = subprocess.check_output([oldest_transformers, "-c", "import transformers; print(transformers.__version__)"],
                                      text=True).strip()
    assert version.startswith(f"{OLDEST}.") and sys.executable != str(oldest_transformers)


@pytest.mark.heavy
def test_bart_with_layerdrop_zero_plans_and_trains_exactly_on_the_oldest_transformers(
    oldest_transformers: Path, tmp_path: Path
):
    plan = tmp_path / "plan.json"
    planned = _deeppool(oldest_transformers, "plan", str(ROOT / "tests/models/zoo/hf_bart.py"), "--gpus", "2",
                        "--batch", "4", "--device-model", "a100", "--pin", "linear*=2", "--pin", "layer_norm*=1",
                        "--out", str(plan))
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert "specialised branch at " in planned.stdout and "modeling_bart.py" in planned.stdout
    assert len({layer["gpus"] for layer in json.loads(plan.read_text())["layers"]}) == 2
    ran = _deeppool(oldest_transformers, "run", str(plan), "--nproc", "2", "--steps", "2", "--warmup", "0",
                    "--check", "--out", str(tmp_path / "run"))
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert "max relative difference" in ran.stdout, ran.stdout[-3000:]
