"""docs/library.md runs: its files are written out, planned, and trained by `deeppool run --script` and by
plain torchrun; the mixed-precision step it shows trains with every rank skipping the same steps; its
Lightning script trains under `deeppool run --script` and its checkpoint loads into the plain module; its
K-FAC loop learns and saves its factors."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.net import free_port

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "library.md"
pytestmark = pytest.mark.slow

AMP_CHECK = '''
import os, sys
import torch
import deeppool
from amp_step import amp_step
from model import model

plan = deeppool.Plan.load(os.environ["DEEPPOOL_PLAN"])
bp = deeppool.parallelize(model(), plan)
opt = torch.optim.SGD(bp.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, growth_interval=1)
x, y = torch.randn(plan.global_batch, 32), torch.randint(0, 10, (plan.global_batch,))
scales = []
for _ in range(6):
    loss = amp_step(bp, opt, scaler, x, y, lambda out, y: 1e4 * torch.nn.functional.cross_entropy(out, y))
    scales.append(scaler.get_scale())
print(f"rank {bp.rank} scales {scales} loss {loss.item():.4f}", flush=True)
'''


def files(text: str) -> dict[str, str]:
    """The guide's code blocks whose first line is ``# NAME.py``, by name."""
    blocks = re.findall(r"```python\n# (\S+\.py)\n(.*?)```", text, flags=re.S)
    return {name: body for name, body in blocks}


def shell(text: str) -> list[str]:
    return [line.strip() for block in re.findall(r"```sh long\n(.*?)```", text, flags=re.S) for line in block.splitlines()]


def run(args: list[str], where: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{where}", "OMP_NUM_THREADS": "1", **extra}
    return subprocess.run(args, cwd=where, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.heavy  # a doc's shell blocks, as every doc's but the README's (20 s)
def test_the_guide_runs(tmp_path: Path) -> None:
    text = GUIDE.read_text()
    for name, body in files(text).items():
        (tmp_path / name).write_text(body)
    assert {"model.py", "train.py", "amp_step.py", "lightning_train.py", "kfac_train.py"} <= set(files(text))
    commands = shell(text)
    plan_command = next(c for c in commands if c.startswith("deeppool plan"))
    assert "deeppool run --script train.py plan.json" in commands
    assert "torchrun --nproc-per-node 2 train.py" in commands
    deeppool = [sys.executable, "-m", "deeppool.cli"]
    planned = run([*deeppool, *plan_command.split()[1:]], tmp_path)
    assert planned.returncode == 0, planned.stderr[-2000:]
    trained = run([*deeppool, "run", "--script", "train.py", "plan.json", "--out", "run"], tmp_path)
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    losses = [float(v) for v in re.findall(r"loss (\d+\.\d+)", trained.stdout)]
    assert len(losses) == 4 and losses[-1] < losses[0], trained.stdout
    assert "accuracy on the last batch" in trained.stdout
    namespace: dict[str, object] = {}
    exec((tmp_path / "model.py").read_text(), namespace)  # noqa: S102 - the guide's own model file
    plain = namespace["model"]()
    plain.load_state_dict(torch.load(tmp_path / "model.pt"))  # the checkpoint loads into the plain module
    assert "deeppool run --script lightning_train.py plan.json" in commands
    lightning = run([*deeppool, "run", "--script", "lightning_train.py", "plan.json", "--out", "lightning"], tmp_path)
    assert lightning.returncode == 0, lightning.stdout[-2000:] + lightning.stderr[-2000:]
    final = re.search(r"lightning: loss (\d+\.\d+) after 20 steps", lightning.stdout)
    assert final is not None and float(final[1]) < 2.0, lightning.stdout[-2000:]  # it learned (from ~2.3)
    checkpoint = torch.load(tmp_path / "lightning.ckpt", weights_only=False)["state_dict"]
    plain.load_state_dict({key.removeprefix("model."): value for key, value in checkpoint.items()})
    preconditioned = run([*deeppool, "run", "--script", "kfac_train.py", "plan.json", "--out", "kfac"], tmp_path)
    assert preconditioned.returncode == 0, preconditioned.stdout[-2000:] + preconditioned.stderr[-2000:]
    found = re.search(r"kfac: loss (\d+\.\d+) after 10 steps on (.*)", preconditioned.stdout)
    assert found is not None and float(found[1]) < 2.0, preconditioned.stdout[-2000:]  # it learned (from ~2.3)
    assert set(torch.load(tmp_path / "kfac.pt")["layers"]) == set(found[2].split(", "))
    (tmp_path / "amp_check.py").write_text(AMP_CHECK)
    checked = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                   str(free_port()), "amp_check.py"], tmp_path, DEEPPOOL_PLAN=str(tmp_path / "plan.json"))
    assert checked.returncode == 0, checked.stderr[-2000:]
    scales = re.findall(r"rank \d scales (\[.*?\])", checked.stdout)
    assert len(scales) == 2 and scales[0] == scales[1], checked.stdout  # every rank skipped the same steps
    assert eval(scales[0])[0] < 2.0**127  # noqa: S307 - the first steps overflowed and backed off
