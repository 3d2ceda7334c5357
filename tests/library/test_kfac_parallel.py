"""K-FAC in a user's loop over ``deeppool.parallelize``: 3 steps on a burst plan of 4 gloo ranks give the
parameters of the same loop in one process (factors all-reduced within each layer's group from its ranks'
rows, eigendecompositions round-robin over the group, the preconditioned gradient sent to the group)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.executor.plans import cycle, make_plan_for
from tests.library import kfac_loop
from tests.library.test_parallelize import CNN, REPO, env
from tests.net import free_port


@pytest.mark.heavy  # 15 s; the executor's K-FAC on 4 gloo ranks is in the default run (test_executor_kfac.py)
def test_kfac_on_a_burst_plan_equals_one_process(tmp_path: Path) -> None:
    batch = 6
    plan = make_plan_for(CNN, global_batch=batch, gpus=4, assign=cycle(4, 2, 1, 3))
    assert len({layer.gpus for layer in plan.layers}) >= 3
    plan.save(tmp_path / "plan.json")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(free_port()),
         str(REPO / "tests/library/kfac_loop.py"), str(tmp_path), CNN, str(tmp_path / "plan.json")],
        check=False, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(4)]
    assert ranks[0]["layers"] == ("stem.0", "block.0", "down", "head")   # rank 0 holds every layer
    assert all(set(r["layers"]) <= set(ranks[0]["layers"]) for r in ranks)
    assert len({r["layers"] for r in ranks}) > 1                           # others hold some
    reference, losses = kfac_loop.reference(CNN, batch, ranks[0]["initial"])
    assert ranks[0]["losses"] == pytest.approx(losses, rel=1e-5)
    expected = reference.state_dict()
    plain = kfac_loop.reference(CNN, batch, ranks[0]["initial"], kfac=False)[0].state_dict()
    assert not torch.allclose(plain["head.weight"], expected["head.weight"], rtol=1e-2)   # K-FAC changed the steps
    for rank in ranks:
        for key, value in rank["state"].items():
            torch.testing.assert_close(value, expected[key], rtol=1e-4, atol=1e-5, msg=key)
