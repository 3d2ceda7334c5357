"""The background job really trains, in micro-steps too, and resumes from its checkpoint exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deeppool.executor.config import OptimizerConfig
from deeppool.multiplex.job import BackgroundJob, load_background
from deeppool.plans import Optimizer
from tests.multiplex.plans import BACKGROUND

ADAM = OptimizerConfig(kind=Optimizer.ADAM, lr=0.01)


def job(checkpoint: Path | None = None, batch: int = 16) -> BackgroundJob:
    return BackgroundJob(load_background(BACKGROUND), batch=batch, optimizer=ADAM, checkpoint=checkpoint)


def test_loss_falls() -> None:
    j = job()
    losses = [j.train_step() for _ in range(60)]
    assert sum(losses[-10:]) / 10 < 0.6 * sum(losses[:10]) / 10
    assert j.step == 60 and j.samples == 60 * 16


def test_micro_steps_make_the_same_step() -> None:
    whole, parts = job(), job()
    whole.train_step()
    pieces = [parts.micro_step(rows) for rows in (5, 5, 6)]
    assert [p.stepped for p in pieces] == [False, False, True]
    for a, b in zip(whole.module.parameters(), parts.module.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # Adam normalises tiny sums


def test_resumes_from_its_checkpoint_exactly(tmp_path: Path) -> None:
    straight = job()
    for _ in range(6):
        straight.train_step()
    first = job(tmp_path / "bg.pt")
    for _ in range(3):
        first.train_step()
    first.save()
    assert not list(tmp_path.glob("*.tmp*"))  # written atomically
    resumed = job(tmp_path / "bg.pt")
    assert resumed.step == 3
    for _ in range(3):
        resumed.train_step()
    for a, b in zip(straight.module.parameters(), resumed.module.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_warm_up_leaves_the_training_as_it_was() -> None:
    """Batch-norm statistics, dropout's RNG draws, gradients and data: the warmed job trains the same steps."""
    stateful = Path(__file__).parent / "models" / "stateful_bg.py"
    cold, warm = (BackgroundJob(load_background(stateful), batch=8, optimizer=ADAM, seed=3) for _ in range(2))
    torch.manual_seed(0)
    cold_losses = [cold.train_step() for _ in range(3)]
    torch.manual_seed(0)
    rng = torch.get_rng_state()
    assert warm.warm_up() > 0
    assert torch.equal(torch.get_rng_state(), rng)
    warm_losses = [warm.train_step() for _ in range(3)]
    assert warm_losses == cold_losses
    for a, b in zip(cold.module.state_dict().values(), warm.module.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_warm_up_inside_a_batch_is_refused() -> None:
    j = job()
    j.micro_step(4)
    with pytest.raises(RuntimeError, match="step boundary"):
        j.warm_up()
