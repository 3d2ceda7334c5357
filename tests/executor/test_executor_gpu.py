"""The NCCL path on real GPUs: --check against single-process training. Skips without CUDA."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.executor.plans import cycle, make_plan
from tests.executor.test_executor_processes import deeppool_run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _ranks() -> int:
    """NCCL refuses two ranks on one GPU: as many ranks as GPUs, at most 4."""
    return max(1, min(4, torch.cuda.device_count()))


@pytest.mark.parametrize("name", ["residual", "tiny_gpt"])
def test_nccl_check_matches_single_process(tmp_path: Path, name: str) -> None:
    ranks = _ranks()
    plan_path = tmp_path / "plan.json"
    make_plan(name, global_batch=7, gpus=ranks, assign=cycle(*range(ranks, 0, -1))).save(plan_path)
    proc, _ = deeppool_run(plan_path, "--nproc", str(ranks), "--steps", "3", "--check", "--backend", "nccl",
                           "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = re.search(r"^max relative difference: (\S+) \(", proc.stdout, re.MULTILINE)
    assert found is not None and float(found.group(1)) <= 1e-4, proc.stdout  # a tenth of the default bound
