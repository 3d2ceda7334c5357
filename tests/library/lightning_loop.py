"""A ``LightningModule`` trained by a Lightning ``Trainer`` two ways: with Lightning's own single-device
strategy in one process (the reference, :func:`fit`), and with ``DeeppoolStrategy`` on every rank of a
torchrun job (``python lightning_loop.py OUT JOB...``, each JOB ``model_file:plan.json``). AdamW with
OneCycleLR stepped every optimizer step, ``gradient_clip_val``, ``accumulate_grad_batches``, a logged
loss, a validation run and a checkpoint, as a Lightning user writes them."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from tests.library.user_loop import ACCUMULATE, LR, STEPS, batches, model_file


class Classifier(pl.LightningModule):
    def __init__(self, net: torch.nn.Module, loss: Any) -> None:
        super().__init__()
        self.model = net
        self.loss_fn = loss
        self.losses: list[float] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self.model(x), y)
        self.log("train_loss", loss)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self.loss_fn(self.model(x), y), sync_dist=True)  # the strategy's reduce

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=STEPS)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loaders(path: str, global_batch: int) -> tuple[DataLoader, DataLoader]:
    """The same global batches as :mod:`tests.library.user_loop`'s, in order; validation on the first."""
    data = batches(model_file(path), global_batch)
    train = TensorDataset(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data]))
    return (DataLoader(train, batch_size=global_batch, shuffle=False),
            DataLoader(TensorDataset(*data[0]), batch_size=global_batch))


def fit(path: str, global_batch: int, out: Path, strategy: Any, **devices: Any) -> tuple[Classifier, pl.Trainer, float]:
    """Train the model file's module (seed 0) for ``STEPS`` optimizer steps; then validate."""
    model = model_file(path)
    torch.manual_seed(0)
    module = Classifier(model.model(), model.loss)
    trainer = pl.Trainer(strategy=strategy, max_steps=STEPS, accumulate_grad_batches=ACCUMULATE,
                         gradient_clip_val=1.0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0,
                         default_root_dir=out, **devices)
    train, val = loaders(path, global_batch)
    trainer.fit(module, train)
    (metrics,) = trainer.validate(module, val, verbose=False)
    return module, trainer, float(metrics["val_loss"])


def parallel(path: str, plan_path: str, out: Path) -> dict[str, Any]:
    from deeppool import Plan
    from deeppool.integrations.lightning import DeeppoolStrategy

    plan = Plan.load(plan_path)
    strategy = DeeppoolStrategy(plan)
    module, trainer, val = fit(path, plan.global_batch, out, strategy)
    trainer.save_checkpoint(out / f"{Path(path).stem}.ckpt")
    bp = strategy.parallelized
    return {"losses": module.losses, "val": val, "rank": bp.rank,
            "held": {key: value.detach().clone() for key, value in bp.held_tensors().items()}}


def main(out: str, jobs: list[str]) -> None:
    results = {}
    for job in jobs:
        path, _, plan_path = job.partition(":")
        results[Path(path).stem] = parallel(path, plan_path, Path(out))
    rank = next(iter(results.values()))["rank"]
    torch.save(results, Path(out) / f"lightning-rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
