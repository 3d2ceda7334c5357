"""The GPU paths of the executor, with their logic run here.

* Through the fake GPU (CPU, CI): a plan trained with the side-stream all-reduce, device events and
  synchronisation gives the same losses and weights as plain gloo, every stream wait checked.
* An injected missing wait in the side-stream all-reduce is an error.
* ``deeppool run --check`` as the NCCL test calls it: with gloo here, with NCCL where there are GPUs
  (as many ranks as GPUs, at most 4; on a one-GPU host one rank, since NCCL refuses two ranks on one
  GPU, plus the single-rank collective check of :mod:`tests.executor.collective_probe`).
"""

from __future__ import annotations

import datetime
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from deeppool.device.fake import FakeGpu, FakeStream, StreamOrderError
from deeppool.executor.engine.comm import Done, Waitable
from deeppool.executor.config import RunConfig
from deeppool.executor.engine.gradients import GradientReducer
from deeppool.device.seam import side_stream
from tests.executor.gloo import Job, train_gloo
from tests.executor.plans import cycle, make_plan
from tests.executor.test_executor_processes import deeppool_run
from tests.net import free_port

CPU = torch.device("cpu")
REPO = Path(__file__).resolve().parents[2]


def _ranks() -> int:
    """NCCL refuses two ranks on one GPU: as many ranks as GPUs, at most 4."""
    return max(1, min(4, torch.cuda.device_count()))


def _check(capfd: pytest.CaptureFixture[str], tmp_path: Path, name: str, ranks: int, backend: str) -> float:
    """``deeppool run --check`` of a plan on ``ranks`` ranks with ``backend``: the max relative difference."""
    plan_path = tmp_path / "plan.json"
    make_plan(name, global_batch=7, gpus=ranks, assign=cycle(*range(ranks, 0, -1))).save(plan_path)
    proc, _ = deeppool_run(capfd, plan_path, "--nproc", str(ranks), "--steps", "3", "--check", "--backend", backend,
                           "--out", str(tmp_path / "out"))
    assert proc.code == 0, proc.stderr[-3000:]
    found = re.search(r"^max relative difference: (\S+) \(", proc.stdout, re.MULTILINE)
    assert found is not None, proc.stdout
    return float(found.group(1))


@pytest.mark.slow
def test_the_nccl_check_runs_its_logic_on_gloo(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    assert _check(capfd, tmp_path, "residual", 2, "gloo") <= 1e-4  # a tenth of the default bound


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["residual", "tiny_gpt"])
def test_nccl_check_matches_single_process(tmp_path: Path, capfd: pytest.CaptureFixture[str], name: str) -> None:
    assert _check(capfd, tmp_path, name, _ranks(), "nccl") <= 1e-4


def _probe(backend: str) -> str:
    done = subprocess.run([sys.executable, "-m", "tests.executor.collective_probe", backend], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_single_rank_collective_probe_runs_on_gloo() -> None:
    assert "collective ok gloo cpu" in _probe("gloo")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_single_rank_nccl_collective_runs_on_one_gpu() -> None:
    assert "collective ok nccl cuda:0" in _probe("nccl")


@pytest.mark.slow
def test_a_plan_trains_the_same_through_the_fake_gpu() -> None:
    plan = make_plan("residual", global_batch=7, gpus=2, assign=cycle(2, 1))
    config = RunConfig(steps=3, bucket_mb=0.004)  # small buckets: several side-stream all-reduces a step
    plain, fake = train_gloo([Job(plan=plan, config=config), Job(plan=plan, config=config, fake_gpu=True)])
    for ours, theirs in zip(plain, fake, strict=True):
        assert ours.losses == pytest.approx(theirs.losses, rel=1e-6)
        for name, value in ours.params.items():
            np.testing.assert_allclose(theirs.params[name], value, rtol=1e-6, atol=1e-7)
    assert fake[0].device_work.get("collective", 0) >= 3, fake[0].device_work  # one bucket a step at least
    assert fake[0].summary is not None and fake[0].summary["iteration_measured_ms"] > 0  # timed with the fake's events


class _GroupComm:
    """The executor's ``Comm`` over one gloo group of one rank (in this process)."""

    def __init__(self) -> None:
        store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=30))
        self.group, self.rank = dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=30)), 0

    def all_reduce(self, tensor: torch.Tensor, ranks: tuple[int, ...], *, async_op: bool = False,
                   **_: object) -> Waitable:
        work = self.group.allreduce([tensor])
        if async_op:
            return work
        work.wait()
        return Done()


def _reduce_through_the_fake(gpu: FakeGpu) -> list[torch.Tensor]:
    with gpu.on(CPU):
        reducer = GradientReducer(_GroupComm(), bucket_bytes=64, side=side_stream(gpu, CPU))  # type: ignore[arg-type]
        grads = [torch.full((40,), 2.0) * 1, torch.ones(3) * 3]  # made on the compute stream
        reducer.add((0,), grads)
        reducer.finish()
        return [g.clone() for g in grads]


def test_the_side_stream_all_reduce_waits_where_it_must() -> None:
    grads = _reduce_through_the_fake(FakeGpu())
    assert grads[0].tolist() == [2.0] * 40 and grads[1].tolist() == [3.0] * 3


def test_a_missing_wait_in_the_side_stream_all_reduce_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The side stream flattens gradients the compute stream made: without its wait the fake refuses."""
    waits = FakeStream.wait_stream
    monkeypatch.setattr(FakeStream, "wait_stream",
                        lambda self, other: None if self.name != "default" else waits(self, other))
    with pytest.raises(StreamOrderError, match="without waiting for it"):
        _reduce_through_the_fake(FakeGpu())
