"""``--check``: single-process training on the same global batches, and the comparison.

The reference is the eager model (not the traced one), built from the same
seeded spec, trained with the same optimizer on the same batches. Dropout is
made the identity in both runs when checking (see :func:`freeze_dropout`), so
both are deterministic. The reported figure, per parameter tensor, is
``max|p − p_ref| / max|p_ref|``, maximised over tensors; the same ratio for the
updates ``p − p0`` is reported too (``max|p − p_ref| / max|p_ref − p0|``,
the update floored at ``UPDATE_FLOOR · max|p_ref|``), since it is the stricter
test when training moves the parameters little.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from deeppool.executor.config import OptimizerConfig
from deeppool.executor.data import BatchSource
from deeppool.executor.local_model import freeze_dropout
from deeppool.planner.modelspec import LoadedModel

Tensors = Mapping[str, torch.Tensor]

UPDATE_FLOOR = 1e-4
"""Updates smaller than this fraction of a tensor's magnitude count as this large."""


@dataclass(frozen=True, kw_only=True)
class Reference:
    initial: dict[str, torch.Tensor]
    final: dict[str, torch.Tensor]
    losses: tuple[float, ...]


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    max_relative_difference: float
    max_relative_update_difference: float
    worst: str
    bound: float

    @property
    def passed(self) -> bool:
        return self.max_relative_difference <= self.bound

    def to_json(self) -> dict[str, Any]:
        return {
            "max_relative_difference": self.max_relative_difference,
            "max_relative_update_difference": self.max_relative_update_difference,
            "worst": self.worst,
            "bound": self.bound,
            "passed": self.passed,
        }


def train_reference(loaded: LoadedModel, batches: BatchSource, *, steps: int, optimizer: OptimizerConfig) -> Reference:
    """Train the eager model (freshly built, untouched) for ``steps`` global batches."""
    model = loaded.module
    model.train()
    freeze_dropout(model)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt = optimizer.build(model.parameters())
    losses = []
    for step in range(steps):
        batch = batches(step)
        loss = loaded.loss(model(*batch.inputs), batch.targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    final = {name: p.detach().clone() for name, p in model.named_parameters()}
    return Reference(initial=initial, final=final, losses=tuple(losses))


def compare(params: Tensors, reference: Reference, *, bound: float) -> CheckResult:
    """Worst relative difference over ``params`` (the ones this rank holds)."""
    worst, worst_name, worst_update = 0.0, "", 0.0
    for name, value in params.items():
        rel, rel_update = _ratios(value.detach().cpu().double(), reference.final[name].double(),
                                  reference.initial[name].double())
        if rel > worst or not worst_name:
            worst, worst_name = rel, name
        worst_update = max(worst_update, rel_update)
    return CheckResult(
        max_relative_difference=worst, max_relative_update_difference=worst_update, worst=worst_name, bound=bound
    )


def _ratios(got: torch.Tensor, want: torch.Tensor, initial: torch.Tensor) -> tuple[float, float]:
    if not got.numel():
        return 0.0, 0.0
    diff = float((got - want).abs().max())
    scale = float(want.abs().max())
    moved = float((want - initial).abs().max())
    rel = diff / scale if scale > 0 else diff
    floor = max(moved, UPDATE_FLOOR * scale)  # a parameter that barely moves (a bias before BatchNorm)
    return rel, (diff / floor if floor > 0 else rel)
