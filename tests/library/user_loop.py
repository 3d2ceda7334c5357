"""A user's own training loop, written once and run two ways: on the plain module in one process (the
reference) and over ``deeppool.parallelize`` on every rank of a torchrun job (``python user_loop.py
OUT JOB...``, each JOB ``model_file:plan.json``). AdamW (fused when asked) with OneCycleLR, global-norm
clipping, and gradient accumulation through ``no_sync``; the parallel run feeds the CNN only the rows
``rank_rows`` names."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

STEPS = 3
ACCUMULATE = 2
LR = 3e-3


def model_file(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def batches(model: ModuleType, global_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS × ACCUMULATE`` different global batches (the model file's, shifted by a seeded draw)."""
    generator = torch.Generator().manual_seed(7)
    (x,), y = model.inputs(global_batch), model.targets(global_batch)
    found = []
    for _ in range(STEPS * ACCUMULATE):
        order = torch.randperm(global_batch, generator=generator)
        found.append((x[order], y[order]))
    return found


def train(params: list[torch.nn.Parameter], step: Callable[[Any, Any, bool], torch.Tensor],
          clip: Callable[[float], torch.Tensor], data: list[tuple[torch.Tensor, torch.Tensor]],
          *, fused: bool) -> list[float]:
    """The loop: ``step(x, y, last)`` runs forward and backward (``last``: the accumulation's last)."""
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=0.01, fused=fused)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=STEPS)
    losses = []
    for index in range(STEPS):
        micro = data[index * ACCUMULATE : (index + 1) * ACCUMULATE]
        loss = sum(float(step(x, y, k == ACCUMULATE - 1)) for k, (x, y) in enumerate(micro))
        clip(1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss)
    return losses


def reference(path: str, global_batch: int, state: dict[str, torch.Tensor]) -> tuple[torch.nn.Module, list[float]]:
    """The loop on the plain module in this process, from ``state``."""
    model = model_file(path)
    module = model.model()
    module.load_state_dict(state)

    def step(x: torch.Tensor, y: torch.Tensor, last: bool) -> torch.Tensor:
        del last
        loss = model.loss(module(x), y)
        loss.backward()
        return loss.detach()

    losses = train(list(module.parameters()), step,
                   lambda limit: torch.nn.utils.clip_grad_norm_(module.parameters(), limit),
                   batches(model, global_batch), fused=True)
    return module, losses


def parallel(path: str, plan_path: str) -> dict[str, Any]:
    """The loop over ``deeppool.parallelize`` on this rank; its state and losses."""
    import deeppool

    model = model_file(path)
    plan = deeppool.Plan.load(plan_path)
    torch.manual_seed(0)
    module = model.model()
    initial = {key: value.clone() for key, value in module.state_dict().items()}
    bp = deeppool.parallelize(module, plan)
    rows = bp.rank_rows(plan.global_batch)
    only_mine = "cnn" in Path(path).stem

    def step(x: torch.Tensor, y: torch.Tensor, last: bool) -> torch.Tensor:
        if only_mine:
            x, y = x[rows], y[rows]
        if last:
            return bp.step(x, y, model.loss)
        with bp.no_sync():
            return bp.step(x, y, model.loss)

    losses = train(list(bp.parameters()), step, bp.clip_grad_norm_, batches(model, plan.global_batch), fused=True)
    (x,) = model.inputs(plan.global_batch)
    output = bp.eval().eval_step(x)
    return {"initial": initial, "losses": losses, "state": bp.state_dict(), "rank": bp.rank,
            "names": [name for name, _ in bp.named_parameters()], "eval": output}


def main(out: str, jobs: list[str]) -> None:
    results = {}
    for job in jobs:
        path, _, plan_path = job.partition(":")
        results[Path(path).stem] = parallel(path, plan_path)
    rank = next(iter(results.values()))["rank"]
    torch.save(results, Path(out) / f"rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
