"""``DeeppoolStrategy``: a Lightning ``Trainer`` on a burst plan of 4 gloo ranks (torchrun) equals the same
``Trainer`` with Lightning's own strategy in one process: the logged losses, the validation loss, every
rank's parameters and buffers, and rank 0's checkpoint, which loads into the plain module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from deeppool.errors import DeeppoolError  # noqa: E402
from tests.executor.plans import cycle, make_plan_for  # noqa: E402
from tests.library import lightning_loop, user_loop  # noqa: E402
from tests.library.test_parallelize import CNN, JOBS, env, plans  # noqa: E402
from tests.net import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_lightning_trainer_on_a_burst_plan_equals_one_process(tmp_path: Path) -> None:
    names = ["cnn", "transformer"]
    jobs = plans(tmp_path, names)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
                           str(free_port()), str(REPO / "tests/library/lightning_loop.py"), str(tmp_path), *jobs],
                          cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"lightning-rank{r}.pt", weights_only=False) for r in range(4)]
    for name in names:
        path, batch, _ = JOBS[name]
        reference, _, val = lightning_loop.fit(path, batch, tmp_path / "reference", "auto", accelerator="cpu",
                                               devices=1)
        expected = reference.model.state_dict()
        assert len(reference.losses) == user_loop.STEPS * user_loop.ACCUMULATE
        for rank in ranks:
            assert rank[name]["losses"] == pytest.approx(reference.losses, rel=1e-5)
            assert rank[name]["val"] == pytest.approx(val, rel=1e-5)
            for key, value in rank[name]["held"].items():
                torch.testing.assert_close(value, expected[key], rtol=1e-4, atol=1e-5, msg=f"{name} {key}")
        assert set(ranks[0][name]["held"]) == set(expected)  # rank 0 trains the whole model
        checkpoint = torch.load(tmp_path / f"{name}.ckpt", weights_only=False)["state_dict"]
        plain = user_loop.model_file(path).model()
        plain.load_state_dict({key.removeprefix("model."): value for key, value in checkpoint.items()})
        for key, value in plain.state_dict().items():
            torch.testing.assert_close(value, expected[key], rtol=1e-4, atol=1e-5, msg=f"{name} checkpoint {key}")


def test_the_strategy_refuses_what_it_cannot_run() -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision

    from deeppool.integrations.lightning import DeeppoolStrategy

    plan = make_plan_for(CNN, global_batch=2, gpus=1, assign=cycle(1))
    with pytest.raises(DeeppoolError, match="32-bit precision, not with MixedPrecision"):
        DeeppoolStrategy(plan).precision_plugin = MixedPrecision("bf16-mixed", "cpu")
    with pytest.raises(DeeppoolError, match="bucket_mb=-1 is negative"):
        DeeppoolStrategy(plan, bucket_mb=-1)
    model = lightning_loop.Classifier(user_loop.model_file(CNN).model(), torch.nn.functional.cross_entropy)
    strategy = DeeppoolStrategy(plan, module="net")
    strategy.connect(model)
    with pytest.raises(DeeppoolError, match="no module 'net'"):
        strategy._parallelize()
