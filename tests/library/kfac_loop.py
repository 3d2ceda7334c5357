"""A user's loop with K-FAC, run two ways: on the plain module in one process (the reference) and over
``deeppool.parallelize`` on every rank of a torchrun job (``python kfac_loop.py OUT MODEL_FILE PLAN``).
SGD with momentum, K-FAC between the backward and the step, global-norm clipping after it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

import deeppool
from tests.library.user_loop import model_file

STEPS = 3
KFAC = {"lr": 0.05, "damping": 0.01, "factor_decay": 0.9, "inv_update_steps": 2, "kl_clip": 0.01}


def batches(model, global_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    (x,), y = model.inputs(global_batch), model.targets(global_batch)
    return [(x[order], y[order]) for order in (torch.randperm(global_batch, generator=generator) for _ in range(STEPS))]


def train(target: nn.Module | deeppool.library.Parallelized, step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
          clip: Callable[[float], torch.Tensor], data: list[tuple[torch.Tensor, torch.Tensor]], *,
          kfac: bool = True) -> list[float]:
    opt = torch.optim.SGD(target.parameters(), lr=KFAC["lr"], momentum=0.9)
    preconditioner = deeppool.kfac(target, **KFAC) if kfac else None
    losses = []
    for x, y in data:
        loss = step(x, y)
        if preconditioner is not None:
            preconditioner.step()
        clip(1.0)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def reference(path: str, global_batch: int, state: dict[str, torch.Tensor], *,
              kfac: bool = True) -> tuple[nn.Module, list[float]]:
    """The loop on the plain module in this process, from ``state`` (``kfac``: with K-FAC, else plain SGD)."""
    model = model_file(path)
    module = model.model()
    module.load_state_dict(state)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = model.loss(module(x), y)
        loss.backward()
        return loss.detach()

    losses = train(module, step, lambda limit: nn.utils.clip_grad_norm_(module.parameters(), limit),
                   batches(model, global_batch), kfac=kfac)
    return module, losses


def main(out: str, path: str, plan_path: str) -> None:
    model = model_file(path)
    plan = deeppool.Plan.load(plan_path)
    torch.manual_seed(0)
    module = model.model()
    initial = {key: value.clone() for key, value in module.state_dict().items()}
    bp = deeppool.parallelize(module, plan)
    losses = train(bp, lambda x, y: bp.step(x, y, model.loss), bp.clip_grad_norm_, batches(model, plan.global_batch))
    layers = deeppool.kfac(bp, **KFAC).layers
    torch.save({"initial": initial, "losses": losses, "state": bp.state_dict(), "layers": layers},
               Path(out) / f"rank{bp.rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
