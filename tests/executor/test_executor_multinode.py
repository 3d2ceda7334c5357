"""Several machines: `deeppool run --nnodes N --rdzv-endpoint HOST:PORT --rdzv-id ID` on each, as with torchrun.

Two launchers on this machine stand for two machines: each starts its share of
the ranks, they meet at the rendezvous, and the burst plan trains exactly as
single-process training does (--check). Only the rank-0 machine writes the
summary.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.executor.plans import cycle, make_plan

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node(plan: Path, out: Path, *, nnodes: int, nproc: int, endpoint: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "deeppool.cli", "run", str(plan), "--nnodes", str(nnodes), "--nproc", str(nproc),
         "--rdzv-endpoint", endpoint, "--rdzv-id", "multinode-test", "--steps", "3", "--check", "--lr", "0.1",
         "--out", str(out)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_machines_train_a_burst_plan_exactly(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    make_plan("residual", global_batch=7, gpus=4, assign=cycle(1, 4, 2, 3)).save(plan)
    endpoint = f"127.0.0.1:{free_port()}"
    machines = [node(plan, tmp_path / f"machine{i}", nnodes=2, nproc=2, endpoint=endpoint) for i in range(2)]
    outputs = [m.communicate(timeout=240)[0] for m in machines]
    assert [m.returncode for m in machines] == [0, 0], outputs
    summaries = [json.loads(p.read_text()) for p in tmp_path.glob("machine*/summary.json")]
    assert len(summaries) == 1  # rank 0's machine reports the run
    assert summaries[0]["gpus"] == 4 and summaries[0]["check"]["passed"]
    traces = sorted(p.name for p in tmp_path.glob("machine*/trace-rank*.json"))
    assert traces == [f"trace-rank{r}.json" for r in range(4)]  # every global rank ran somewhere


@pytest.mark.parametrize(("args", "message"), [
    (["--nnodes", "2"], "needs --rdzv-endpoint"),
    (["--nnodes", "2", "--rdzv-endpoint", "nohost", "--rdzv-id", "x"], "is not HOST:PORT"),
    (["--nnodes", "2", "--nproc", "3", "--rdzv-endpoint", "h:1", "--rdzv-id", "x"], "--nproc x --nnodes = 4"),
    (["--nnodes", "0"], "--nnodes 0"),
])
def test_multi_machine_mistakes_are_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    plan = tmp_path / "plan.json"
    make_plan("residual", global_batch=7, gpus=4, assign=cycle(1, 4, 2, 3)).save(plan)
    done = subprocess.run([sys.executable, "-m", "deeppool.cli", "run", str(plan), *args, "--out", str(tmp_path / "o")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error:") and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
