"""``deeppool.parallelize``: a user's loop on a burst plan of 4 gloo ranks equals the same loop in one process.

The loop (:mod:`tests.library.user_loop`) uses fused AdamW, OneCycleLR, global-norm clipping and
gradient accumulation through ``no_sync``, on a held-out CNN (BatchNorm, a residual add; fed only the
rows ``rank_rows`` names) and a transformer (tied embeddings). One node under plain torchrun, and two
"machines" (two torchrun agents on this one) meeting at a loopback rendezvous.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.executor.plans import cycle, make_plan_for
from tests.library import user_loop
from tests.net import free_port

REPO = Path(__file__).resolve().parents[2]
MODELS = Path(__file__).resolve().parent / "models"
CNN, TRANSFORMER = str(MODELS / "cnn.py"), str(MODELS / "transformer.py")
JOBS = {"cnn": (CNN, 6, cycle(4, 2, 1, 3)), "transformer": (TRANSFORMER, 5, cycle(2, 4, 1, 3, 4))}


def plans(tmp_path: Path, names: list[str]) -> list[str]:
    jobs = []
    for name in names:
        path, batch, assign = JOBS[name]
        plan = make_plan_for(path, global_batch=batch, gpus=4, assign=assign)
        assert len({layer.gpus for layer in plan.layers}) >= 2  # a burst plan
        plan.save(tmp_path / f"{name}.json")
        jobs.append(f"{path}:{tmp_path / f'{name}.json'}")
    return jobs


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args, str(REPO / "tests/library/user_loop.py")]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}  # stacks


def check_against_reference(out: Path, names: list[str]) -> None:
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]
    for name in names:
        path, batch, _ = JOBS[name]
        first = ranks[0][name]
        reference, losses = user_loop.reference(path, batch, first["initial"])
        expected = reference.state_dict()
        assert first["losses"] == pytest.approx(losses, rel=1e-5)
        assert set(first["state"]) == set(expected)  # rank 0's state dict is the whole model's
        for rank in ranks:  # every rank's part equals the reference: merging them by key gives rank 0's
            for key, value in rank[name]["state"].items():
                torch.testing.assert_close(value, expected[key], rtol=1e-4, atol=1e-5, msg=f"{name} {key}")
        plain = user_loop.model_file(path).model()
        plain.load_state_dict(first["state"])  # a checkpoint loads into the plain module unchanged
        (x,) = user_loop.model_file(path).inputs(batch)
        plain.eval()
        reference.eval()
        with torch.no_grad():
            torch.testing.assert_close(plain(x), reference(x))
            for rank in ranks:  # eval_step: the whole batch's output, on every rank
                torch.testing.assert_close(rank[name]["eval"], reference(x), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_user_loop_under_torchrun_equals_one_process(tmp_path: Path) -> None:
    jobs = plans(tmp_path, ["cnn", "transformer"])
    done = subprocess.run([*torchrun("--nproc-per-node", "4", "--master-port", str(free_port())), str(tmp_path), *jobs],
                          cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    saved = sorted(path.name for path in tmp_path.glob("rank*.pt"))  # a rank that failed at exit saved its own
    assert done.returncode == 0, f"ranks saved: {saved}\n{done.stderr[:4000]}"
    check_against_reference(tmp_path, ["cnn", "transformer"])


@pytest.mark.slow
@pytest.mark.heavy
def test_a_user_loop_on_two_machines_meeting_at_a_rendezvous_equals_one_process(tmp_path: Path) -> None:
    jobs = plans(tmp_path, ["cnn"])
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [subprocess.Popen([*torchrun("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                                          "--rdzv-endpoint", endpoint, "--rdzv-id", "library-test"),
                                str(tmp_path), *jobs], cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [agent.communicate(timeout=300)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], [output[-3000:] for output in outputs]
    check_against_reference(tmp_path, ["cnn"])


UNREAD_LOSSES = """
import importlib.util, sys
import torch
import deeppool
spec = importlib.util.spec_from_file_location("cnn", sys.argv[1])
cnn = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cnn)
plan = deeppool.Plan.load(sys.argv[2])
bp = deeppool.parallelize(cnn.model(), plan)
opt = torch.optim.SGD(bp.parameters(), lr=0.1)
(x,), y = cnn.inputs(plan.global_batch), cnn.targets(plan.global_batch)
for _ in range(3):
    bp.step(x, y, cnn.loss)  # the loss is never read: its all-reduce is never waited for by the loop
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.slow
@pytest.mark.heavy
def test_a_loop_that_never_reads_its_losses_leaves_no_collective_unwaited(tmp_path: Path) -> None:
    """Each step's loss all-reduce runs in the background; the library waits for every one (the last at exit),
    so torch does not warn of unwaited collectives when the script ends."""
    make_plan_for(CNN, global_batch=4, gpus=2, assign=cycle(2, 1)).save(tmp_path / "plan.json")
    (tmp_path / "unread.py").write_text(UNREAD_LOSSES)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), str(tmp_path / "unread.py"), CNN, str(tmp_path / "plan.json")],
                          cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "unwaited collective" not in done.stderr, done.stderr[-3000:]
