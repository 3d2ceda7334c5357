"""``--check``: single-process training on the same global batches, and the comparison.

The reference is the eager model (not the traced one), a copy of the rank's
model as built from the seeded spec (before tracing; the rank builds its model
once), trained with the same optimizer on the same batches. Dropout and
every other random op stay on: both runs draw per sample
(:class:`~deeppool.model.randomness.SampleRandomness`, same seed), so the
reference draws for each sample exactly what the ranks draw for it.

``--check`` runs the reference **in lockstep** (:class:`LockstepReference`).
Every step, on every rank, three kinds of tensor are compared with the
reference's (:class:`Kind`):

- the **gradient** of each parameter the rank holds, after the executor's
  gradient all-reduce and before the optimizer step (the engine calls
  :meth:`LockstepReference.gradients_reduced` there): the full gradient of
  the global mean loss, which every rank of a layer holds after the sum;
- the **buffers** of the modules the rank runs (BatchNorm running statistics,
  ``num_batches_tracked``), after the step;
- the **parameters** after the optimizer step, so that an optimizer bug shows.

Then the rank's parameters and buffers are set to the reference's (its
optimizer state stays its own), so every step starts from the same state.
Comparing free-running fp32 trainings after several steps measures chaos, not
correctness (a deep BatchNorm-ReLU network turns a one-ulp difference in a
weight into a different ReLU mask at the next step); one step from equal
parameters is reproducible to round-off (the synchronised BatchNorm computes
the single-process forward bit for bit, see :mod:`deeppool.model.syncbn`).

**Gradients and buffers** are measured per tensor against their own size
(:func:`relative_differences`): ``‖t − t_ref‖ / max(‖t_ref‖, FLOOR · max_u ‖u_ref‖)``,
Frobenius norms, the maximum over all the reference's tensors of that kind
(so every rank uses the same floor). A tensor's own norm is the scale: a
zeroed LayerNorm gradient or a frozen running mean reads 1, however small
the tensor is next to the others. The floor (``FLOOR = 1e-3`` of the largest
norm) is for tensors whose reference value is itself round-off, such as the
gradient of a bias right before BatchNorm or of an attention key bias, which
cancel in exact arithmetic; two correct computations of such a tensor differ
by O(1) of itself. With the default bound of 1e-3 (``RunConfig.check_bound``)
a tensor larger than 1e-3 of the largest must be right to 0.1%, and a zeroed
or dropped one is caught whenever its norm exceeds 1e-6 of the largest. The
figures behind the bounds and floors: ``docs/notes/0023-check-bounds.md``.
A parameter that got no gradient counts as zeros (``None`` on one side only
is a dropped gradient).

**Mixed precision** (``--precision bf16|fp16``): the reference runs under the
same autocast (on the CPU), with ``torch.amp.GradScaler`` for fp16, so a step
skipped for an overflow must be skipped by both (its gradients, inf or NaN,
are not compared; its parameters are). Partial products rounded to bf16/fp16
on each rank and then summed differ from the whole-batch product rounded once
by about one low-precision rounding, so bound and floor grow with the
precision's epsilon (:attr:`~deeppool.executor.config.Precision.check_bound`,
:attr:`~deeppool.executor.config.Precision.check_floor`).

**Parameters** after the step are measured as ``max|p − p_ref|`` over the
largest magnitude among the parameters of the tensor's module
(:func:`module_scales`: ``bn.bias``, which starts at zero, is measured
against the scale of ``bn.weight`` and ``bn.bias``).

:func:`train_reference` and :func:`compare` are the free-running form, used by
the tests on small, well-conditioned models.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from deeppool.adaptation.kfac import KFACPreconditioner
from deeppool.executor.config import LossScaling, OptimizerConfig, Training
from deeppool.executor.engine.data import Batch, BatchSource
from deeppool.executor.engine.precision import autocast, grad_scaler
from deeppool.model.loading import LoadedModel
from deeppool.model.randomness import SampleRandomness
from deeppool.model.trace import BranchWatch, check_branches
from deeppool.plans import Branch, Optimizer, Precision

Tensors = Mapping[str, torch.Tensor]
MaybeTensors = Mapping[str, torch.Tensor | None]

FLOOR = 1e-3
"""A tensor's norm counts as at least this fraction of the largest norm of its kind (see the module docstring)."""

UPDATE_FLOOR = 1e-4
"""Updates smaller than this fraction of a tensor's magnitude count as this large (free-running :func:`compare`)."""


class Kind(enum.Enum):
    """What was compared with the reference."""

    GRADIENT = "gradient"
    BUFFER = "buffer"
    PARAMETER = "parameter"


@dataclass(frozen=True, kw_only=True)
class Difference:
    """One tensor's relative difference from the reference."""

    kind: Kind
    name: str
    value: float
    step: int
    rank: int

    def describe(self) -> str:
        return f"{self.kind.value} of '{self.name}', step {self.step}, rank {self.rank}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "name": self.name, "value": self.value, "step": self.step, "rank": self.rank}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Difference:
        return cls(kind=Kind(data["kind"]), name=str(data["name"]), value=float(data["value"]),
                   step=int(data["step"]), rank=int(data["rank"]))


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    """The largest relative difference of each kind (over tensors, steps, ranks) and the worst tensor."""

    gradient: float
    buffer: float
    parameter: float
    worst: Difference | None
    bound: float

    @property
    def max_relative_difference(self) -> float:
        return max(self.gradient, self.buffer, self.parameter)

    @property
    def passed(self) -> bool:
        return self.max_relative_difference <= self.bound

    def line(self) -> str:
        """``max relative difference: 3.1e-01 (gradient of 'x', step 0, rank 1)``."""
        where = f" ({self.worst.describe()})" if self.worst is not None else ""
        return f"max relative difference: {self.max_relative_difference:.3e}{where}"

    def to_json(self) -> dict[str, Any]:
        return {
            "gradient": self.gradient,
            "buffer": self.buffer,
            "parameter": self.parameter,
            "max_relative_difference": self.max_relative_difference,
            "worst": None if self.worst is None else self.worst.to_json(),
            "bound": self.bound,
            "passed": self.passed,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CheckResult:
        worst = data.get("worst")
        return cls(
            gradient=float(data["gradient"]), buffer=float(data["buffer"]), parameter=float(data["parameter"]),
            worst=None if worst is None else Difference.from_json(worst), bound=float(data["bound"]),
        )


def worst_of(checks: Sequence[CheckResult]) -> CheckResult | None:
    """The largest difference of each kind over steps or ranks, and the worst tensor of all."""
    if not checks:
        return None
    worsts = [c.worst for c in checks if c.worst is not None]
    return CheckResult(
        gradient=max(c.gradient for c in checks),
        buffer=max(c.buffer for c in checks),
        parameter=max(c.parameter for c in checks),
        worst=max(worsts, key=lambda d: d.value) if worsts else None,
        bound=checks[0].bound,
    )


class LockstepReference:
    """Single-process training advanced one step at a time beside one rank of the distributed run.

    ``params`` and ``buffers`` are the ones the rank holds; the engine calls
    :meth:`gradients_reduced` between its gradient all-reduce and its
    optimizer step, and :meth:`step` follows the engine's step.
    """

    def __init__(
        self, loaded: LoadedModel, optimizer: OptimizerConfig, *, params: Mapping[str, nn.Parameter],
        buffers: Tensors, rank: int, bound: float, random: SampleRandomness, training: Training | None = None,
        precision: Precision = Precision.FP32, scaling: LossScaling | None = None, branches: tuple[Branch, ...] = (),
        draws: tuple[Branch, ...] = (), kfac_modules: tuple[str, ...] = (),
    ) -> None:
        """``kfac_modules``: the modules the run preconditions with K-FAC (``--optimizer kfac``), by name."""
        self._loaded = loaded
        self._branches = branches
        self._draws = draws
        self._model = loaded.module.train()
        self._random = random
        self._ref_params = dict(self._model.named_parameters())
        self._ref_buffers = dict(self._model.named_buffers())
        self._optimizer = optimizer.build(self._model.parameters())
        self._training = training or Training()
        self._scheduler = self._training.schedule.build(self._optimizer)
        self._params = params
        self._buffers = {name: b for name, b in buffers.items() if name in self._ref_buffers}  # not fx's constants
        self._rank = rank
        self._bound = bound
        self._gradients: dict[str, torch.Tensor | None] = {}
        self._precision = precision
        device = torch.device("cpu")  # the reference model stays on the CPU
        self._scaler = grad_scaler(scaling or LossScaling(), device) if precision.scaled else None
        self._kfac = None if optimizer.kind is not Optimizer.KFAC else KFACPreconditioner(
            self._model, optimizer.kfac, lr=lambda _: float(self._optimizer.param_groups[0]["lr"]),
            groups={name: (0,) for name in kfac_modules},
            grad_scaler=None if self._scaler is None else self._scaler.get_scale)

    def gradients_reduced(self, step: int) -> None:
        """Keep a copy of the rank's reduced gradients (the engine's ``on_gradients``)."""
        del step
        self._gradients = {name: _detached(p.grad) for name, p in self._params.items()}

    def step(self, step: int, batches: Sequence[Batch]) -> CheckResult:
        """Train the reference on ``batches`` (one optimizer step), compare, then set the rank's
        parameters and buffers to it."""
        micros = len(batches)
        for micro, batch in enumerate(batches):
            watch = BranchWatch(apart=self._draws) if self._branches or self._draws else contextlib.nullcontext()
            with self._random.at(step=step * micros + micro, offset=0, ordinal=0), autocast(
                    self._precision, torch.device("cpu")):
                with watch:  # the branches the plan specialised must go the planned way
                    output = batch.run(self._model)
                loss = self._loaded.loss(output, batch.targets) / micros
            if isinstance(watch, BranchWatch):
                check_branches(self._branches, watch.branches)
            (loss if self._scaler is None else self._scaler.scale(loss)).backward()
        if self._scaler is not None:
            self._scaler.unscale_(self._optimizer)
        reduced = {n: p.grad for n, p in self._ref_params.items()}
        finite = all(bool(torch.isfinite(g).all()) for g in reduced.values() if g is not None)
        # a step with an fp16 overflow is skipped (its gradients are inf/NaN on both sides): its parameters compare
        floor = self._precision.check_floor
        gradients = relative_differences(self._gradients, reduced, floor=floor) if finite else {}
        if self._kfac is not None and finite:
            self._kfac.step()
        elif self._kfac is not None:
            self._kfac.discard()
        if self._training.clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(self._model.parameters(), self._training.clip_norm)
        if self._scaler is None:
            self._optimizer.step()
        else:
            self._scaler.step(self._optimizer)
            self._scaler.update()
        self._optimizer.zero_grad(set_to_none=True)
        self._scheduler.step()
        buffers = relative_differences(self._buffers, self._ref_buffers, floor=floor)
        params = parameter_differences(self._params, {n: p.detach() for n, p in self._ref_params.items()})
        self._gradients = {}
        self._realign()
        found = {Kind.GRADIENT: gradients, Kind.BUFFER: buffers, Kind.PARAMETER: params}
        return self._result(step, found)

    @property
    def loss_scale(self) -> float | None:
        """The reference GradScaler's scale now (fp16), for tests."""
        return None if self._scaler is None else float(self._scaler.get_scale())

    def _realign(self) -> None:
        with torch.no_grad():
            for name, value in self._params.items():
                value.copy_(self._ref_params[name])
            for name, value in self._buffers.items():
                value.copy_(self._ref_buffers[name])

    def _result(self, step: int, found: Mapping[Kind, Mapping[str, float]]) -> CheckResult:
        worst = [self._largest(kind, values, step) for kind, values in found.items() if values]
        return CheckResult(
            gradient=_max(found[Kind.GRADIENT]), buffer=_max(found[Kind.BUFFER]),
            parameter=_max(found[Kind.PARAMETER]),
            worst=max(worst, key=lambda d: d.value) if worst else None, bound=self._bound,
        )

    def _largest(self, kind: Kind, values: Mapping[str, float], step: int) -> Difference:
        """The (first) largest difference of ``kind``."""
        name = max(values, key=values.__getitem__)
        return Difference(kind=kind, name=name, value=values[name], step=step, rank=self._rank)


def relative_differences(got: MaybeTensors, want: MaybeTensors, *, floor: float = FLOOR) -> dict[str, float]:
    """``‖g − w‖ / max(‖w‖, floor · max over all of want ‖w‖)`` for each tensor of ``got``; ``None`` is zeros."""
    norms = {name: _norm(value) for name, value in want.items()}
    least = floor * max(norms.values(), default=0.0)
    found = {}
    for name, value in got.items():
        diff = _norm_of_difference(value, want[name])
        scale = max(norms[name], least)
        found[name] = diff / scale if scale > 0 else diff
    return found


def parameter_differences(params: Tensors, reference: Tensors) -> dict[str, float]:
    """``max|p − p_ref|`` over the largest magnitude among the module's parameters, per tensor of ``params``."""
    scales = module_scales(reference)
    found = {}
    for name, value in params.items():
        if value.numel():
            diff = float((value.detach().cpu().double() - reference[name].double()).abs().max())
            scale = scales[_module(name)]
            found[name] = diff / scale if scale > 0 else diff
    return found


@dataclass(frozen=True, kw_only=True)
class Reference:
    initial: dict[str, torch.Tensor]
    final: dict[str, torch.Tensor]
    losses: tuple[float, ...]


@dataclass(frozen=True, kw_only=True)
class Comparison:
    """Free-running parameters against the reference's: the worst :func:`parameter_differences`,
    and the worst ratio to the tensor's own update."""

    relative: float
    relative_to_update: float
    worst: str


def train_reference(
    loaded: LoadedModel, batches: BatchSource, *, steps: int, optimizer: OptimizerConfig,
    random: SampleRandomness | None = None,
) -> Reference:
    """Train the eager model (freshly built, untouched) for ``steps`` global batches.

    A model that draws random numbers needs ``random``, the executor's per-sample mode. With ``--optimizer
    kfac`` every ``Linear`` and ``Conv2d`` is preconditioned.
    """
    model = loaded.module
    model.train()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    opt = optimizer.build(model.parameters())
    kfac = None if optimizer.kind is not Optimizer.KFAC else KFACPreconditioner(
        model, optimizer.kfac, lr=lambda _: float(opt.param_groups[0]["lr"]))
    losses = []
    for step in range(steps):
        batch = batches(step)
        with random.at(step=step, offset=0, ordinal=0) if random is not None else contextlib.nullcontext():
            output = batch.run(model)
        loss = loaded.loss(output, batch.targets)
        loss.backward()
        if kfac is not None:
            kfac.step()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    final = {name: p.detach().clone() for name, p in model.named_parameters()}
    return Reference(initial=initial, final=final, losses=tuple(losses))


def compare(params: Tensors, reference: Reference) -> Comparison:
    """Worst relative difference over ``params`` (the ones a rank holds) after free-running training.

    The ratio to each tensor's own update (``max|p − p_ref| / max|p_ref − p_0|``,
    the update floored at ``UPDATE_FLOOR · max|p_ref|``) is the stricter test
    when training moves the parameters little.
    """
    found = parameter_differences(params, reference.final)
    worst = max(found, key=found.__getitem__, default="")
    updates = [_update_ratio(params[name], reference.final[name], reference.initial[name]) for name in found]
    return Comparison(relative=found.get(worst, 0.0), relative_to_update=max(updates, default=0.0), worst=worst)


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


def _detached(grad: torch.Tensor | None) -> torch.Tensor | None:
    return None if grad is None else grad.detach().clone()


def _norm(value: torch.Tensor | None) -> float:
    return 0.0 if value is None else float(torch.linalg.vector_norm(value.detach().cpu().double()))


def _norm_of_difference(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    if got is None or want is None:
        return _norm(want if got is None else got)
    return _norm(got.detach().cpu().double() - want.detach().cpu().double())


def _max(values: Mapping[str, float]) -> float:
    return max(values.values(), default=0.0)


def _update_ratio(value: torch.Tensor, want: torch.Tensor, initial: torch.Tensor) -> float:
    got, want, initial = value.detach().cpu().double(), want.double(), initial.double()
    diff = float((got - want).abs().max()) if got.numel() else 0.0
    scale = float(want.abs().max()) if want.numel() else 0.0
    moved = float((want - initial).abs().max()) if want.numel() else 0.0
    floor = max(moved, UPDATE_FLOOR * scale)  # a parameter that barely moves (a bias before BatchNorm)
    if floor > 0:
        return diff / floor
    return diff / scale if scale > 0 else diff
