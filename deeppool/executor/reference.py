"""``--check``: single-process training on the same global batches, and the comparison.

The reference is the eager model (not the traced one), built from the same
seeded spec, trained with the same optimizer on the same batches. Dropout is
made the identity in both runs when checking (see :func:`freeze_dropout`), so
both are deterministic.

``--check`` runs the reference **in lockstep** (:class:`LockstepReference`):
after every step the rank's parameters are compared with the reference's and
then set to them (its optimizer state and BatchNorm buffers stay its own), so
every step starts from the same parameters. Comparing free-running fp32
trainings after several steps measures chaos, not correctness: a deep
BatchNorm-ReLU network turns a one-ulp difference in a weight into a different
ReLU mask at the next step and an O(1) relative difference in some updates —
single-process PyTorch training of Inception or ResNet-50 for 3 steps on 1 and
on 2 CPU threads differs by more than 100% in some BatchNorm biases. One step
from equal parameters is reproducible to round-off (the synchronised
BatchNorm computes the single-process forward bit for bit, see
:mod:`deeppool.executor.syncbn`).

The reported figure, per parameter tensor, is ``max|p − p_ref|`` over the
largest magnitude among its module's parameters (:func:`module_scales`: a
BatchNorm bias, which starts at zero and whose one-step gradient is a
near-cancelling sum, is measured against the scale of the BatchNorm's
weight and bias, not against its own first update), maximised over tensors
and steps. The ratio to each tensor's own update is reported too
(``max|p − p_ref| / max|p_ref − p_prev|``, the update floored at
``UPDATE_FLOOR · max|p_ref|``), since it is the stricter test when a step
moves the parameters little. :func:`train_reference` and :func:`compare` are
the free-running form, used by the tests on small, well-conditioned models.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from deeppool.executor.config import OptimizerConfig
from deeppool.executor.data import Batch, BatchSource
from deeppool.executor.local_model import freeze_dropout
from deeppool.planner.modelspec import LoadedModel
from deeppool.planner.randomness import SampleRandomness

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
    step: int = 0
    """The step (0-based) after which the worst difference was found."""

    @property
    def passed(self) -> bool:
        return self.max_relative_difference <= self.bound

    def to_json(self) -> dict[str, Any]:
        return {
            "max_relative_difference": self.max_relative_difference,
            "max_relative_update_difference": self.max_relative_update_difference,
            "worst": self.worst,
            "step": self.step,
            "bound": self.bound,
            "passed": self.passed,
        }


def worst_of(checks: Sequence[CheckResult]) -> CheckResult | None:
    """The largest difference over steps or ranks (and the largest update difference)."""
    if not checks:
        return None
    worst = max(checks, key=lambda c: c.max_relative_difference)
    return replace(worst, max_relative_update_difference=max(c.max_relative_update_difference for c in checks))


class LockstepReference:
    """Single-process training advanced one step at a time beside the distributed run."""

    def __init__(
        self, loaded: LoadedModel, optimizer: OptimizerConfig, *, bound: float, random: SampleRandomness
    ) -> None:
        self._loaded = loaded
        self._model = loaded.module.train()
        self._random = random
        self._params = dict(self._model.named_parameters())
        self._buffers = dict(self._model.named_buffers())
        self._optimizer = optimizer.build(self._model.parameters())
        self._bound = bound

    def step(self, step: int, batch: Batch, params: Tensors, buffers: Tensors) -> CheckResult:
        """Train the reference on ``batch``, compare ``params``, then set them (and ``buffers``) to it."""
        before = {name: self._params[name].detach().clone() for name in params}
        with self._random.at(step=step, offset=0, ordinal=0):
            output = batch.run(self._model)
        loss = self._loaded.loss(output, batch.targets)
        loss.backward()
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        after = {name: value.detach() for name, value in self._params.items()}
        check = compare(params, Reference(initial=before, final=after, losses=(float(loss.detach()),)), bound=self._bound)
        with torch.no_grad():
            for name, value in params.items():
                value.copy_(after[name])
            for name, value in buffers.items():
                value.copy_(self._buffers[name])
        return replace(check, step=step)


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
        loss = loaded.loss(batch.run(model), batch.targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    final = {name: p.detach().clone() for name, p in model.named_parameters()}
    return Reference(initial=initial, final=final, losses=tuple(losses))


def compare(params: Tensors, reference: Reference, *, bound: float) -> CheckResult:
    """Worst relative difference over ``params`` (the ones this rank holds)."""
    scales = module_scales(reference.final)
    worst, worst_name, worst_update = 0.0, "", 0.0
    for name, value in params.items():
        got, want = value.detach().cpu().double(), reference.final[name].double()
        if not got.numel():
            continue
        diff = float((got - want).abs().max())
        scale = scales[_module(name)]
        rel = diff / scale if scale > 0 else diff
        if rel > worst or not worst_name:
            worst, worst_name = rel, name
        worst_update = max(worst_update, _update_ratio(diff, want, reference.initial[name].double()))
    return CheckResult(
        max_relative_difference=worst, max_relative_update_difference=worst_update, worst=worst_name, bound=bound
    )


def module_scales(params: Tensors) -> dict[str, float]:
    """The largest magnitude among each module's parameters (``bn.weight`` and ``bn.bias`` share one)."""
    scales: dict[str, float] = {}
    for name, value in params.items():
        if value.numel():
            module = _module(name)
            scales[module] = max(scales.get(module, 0.0), float(value.detach().abs().max()))
    return scales


def _module(name: str) -> str:
    return name.rpartition(".")[0]


def _update_ratio(diff: float, want: torch.Tensor, initial: torch.Tensor) -> float:
    scale = float(want.abs().max())
    moved = float((want - initial).abs().max())
    floor = max(moved, UPDATE_FLOOR * scale)  # a parameter that barely moves (a bias before BatchNorm)
    if floor > 0:
        return diff / floor
    return diff / scale if scale > 0 else diff
