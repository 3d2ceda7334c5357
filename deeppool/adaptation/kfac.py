"""K-FAC (Martens & Grosse 2015; Osawa et al., CVPR 2019): Kronecker-factored preconditioning of gradients.

For a ``Linear`` layer ``z = W a`` (the bias as a last column of ``W``, ``a`` with a trailing 1) the
Fisher block is approximated by ``A ⊗ G`` with, over the ``N`` samples of an optimizer step,

    A = (1/N) Σ_i a_i a_iᵀ          G = (1/N) Σ_i (N g_i)(N g_i)ᵀ = N Σ_i g_i g_iᵀ

where ``g_i = ∂L/∂z_i`` is the output gradient the backward sees for the *batch-mean* loss
``L = (1/N) Σ ℓ_i``, so ``N g_i = ∂ℓ_i/∂z_i`` is sample ``i``'s own gradient (the per-sample Fisher; the
loss must be the mean over the step's samples, as ``deeppool run --accumulate`` and ``bp.step`` make it).
``Conv2d`` follows KFC (Grosse & Martens 2016): ``a_il`` are the unfolded input patches at the ``L``
output positions, ``A = (1/N) Σ_il a_il a_ilᵀ``, ``G = (N/L) Σ_il g_il g_ilᵀ``; a ``Linear`` applied to
inputs with extra dimensions treats them as positions alike. Statistics are fp32 whatever the autocast
dtype, and the output gradients are divided by the ``GradScaler``'s scale when one is given.

Every ``factor_update_steps`` steps the batch's factors enter running averages, ``F ← ε F + (1 − ε) F_new``
(``ε = factor_decay``; the first update takes ``F_new`` itself); every ``inv_update_steps`` steps each
factor is eigendecomposed, ``A = Q_A diag(d_A) Q_Aᵀ`` (eigenvalues clamped at 0). The preconditioned
gradient, with damping ``λ`` added to each factor (the factored Tikhonov damping of kfac-pytorch's
inverse method), is

    V = (G + λI)⁻¹ ∇W (A + λI)⁻¹ = Q_G [(Q_Gᵀ ∇W Q_A) / ((d_G + λ)(d_A + λ)ᵀ)] Q_Aᵀ.

KL clipping (kfac-pytorch) scales every preconditioned gradient by ``ν = min(1, √(κ / |Σ lr² V·∇W|))``,
the sum over the preconditioned layers. The result replaces ``.grad``, so any optimizer steps on it;
other layers keep their plain gradient.

Distributed (``collectives``): a layer's rows are spread over the ranks of its group. Each rank sums its
own rows' ``Σ a aᵀ``, ``Σ g gᵀ`` and its row count; one all-reduce per layer in the group gives the sums
of the whole batch, so the factors equal one process's. Each layer's eigendecompositions are computed on
one rank of its group (round-robin over the group's preconditioned layers), which preconditions the
gradient and sends it to the group (an all-reduce to which the other ranks give zeros: exactly a
broadcast). KL clipping's ``ν`` is computed on the first rank of the collectives (it must hold every
preconditioned layer, as rank 0 does in a burst plan) and shared by an all-ranks maximum.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn import functional

from deeppool.adaptation.kfac_options import KfacOptions
from deeppool.errors import DeeppoolError

Rate = float | Callable[[int], float]
"""A learning rate, or a function of the number of steps taken."""


class Collectives(Protocol):
    """The collectives K-FAC needs (a subset of the executor's ``Comm``); ranks are global ranks."""

    rank: int

    def all_reduce(self, tensor: torch.Tensor, ranks: tuple[int, ...]) -> Any:
        """Sum ``tensor`` in place over ``ranks`` (synchronously)."""
        ...

    def all_reduce_max(self, value: float) -> float:
        """The maximum of ``value`` over all ranks."""
        ...


class Alone:
    """:class:`Collectives` of a single process."""

    rank = 0

    def all_reduce(self, tensor: torch.Tensor, ranks: tuple[int, ...]) -> None:
        return None

    def all_reduce_max(self, value: float) -> float:
        return value


@dataclass
class _Layer:
    """One preconditioned module: its group, its step's sums, its factors and their eigendecompositions."""

    name: str
    module: nn.Linear | nn.Conv2d
    ranks: tuple[int, ...]
    owner: int
    sum_a: torch.Tensor | None = None
    sum_g: torch.Tensor | None = None
    rows: int = 0
    positions: int = 1
    a_factor: torch.Tensor | None = None
    g_factor: torch.Tensor | None = None
    eigen: dict[str, torch.Tensor] = field(default_factory=dict)
    """``qa``, ``da``, ``qg``, ``dg`` on the owner rank."""


def preconditionable(module: nn.Module) -> bool:
    """A ``Linear``, or a ``Conv2d`` with one group and zero padding, whose weight is trained."""
    if isinstance(module, nn.Conv2d):
        ok = module.groups == 1 and module.padding_mode == "zeros" and isinstance(module.padding, tuple)
    else:
        ok = isinstance(module, nn.Linear)
    weight = getattr(module, "weight", None)
    return ok and isinstance(weight, nn.Parameter) and weight.requires_grad


def layer_inputs(module: nn.Linear | nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """The rows ``a`` whose second moment is ``A``: (samples, positions, in [+1 for the bias]), fp32."""
    x = x.detach().float()
    if isinstance(module, nn.Conv2d):
        patches = functional.unfold(x, module.kernel_size, dilation=module.dilation, padding=module.padding,
                                    stride=module.stride)
        rows = patches.transpose(1, 2)
    else:
        rows = x.reshape(x.shape[0], -1, x.shape[-1])
    if module.bias is not None:
        rows = torch.cat([rows, rows.new_ones(*rows.shape[:2], 1)], dim=2)
    return rows


def layer_output_grads(module: nn.Linear | nn.Conv2d, g: torch.Tensor) -> torch.Tensor:
    """The output gradients as (samples, positions, out), fp32."""
    g = g.detach().float()
    if isinstance(module, nn.Conv2d):
        return g.flatten(2).transpose(1, 2)
    return g.reshape(g.shape[0], -1, g.shape[-1])


def _gram(rows: torch.Tensor) -> torch.Tensor:
    flat = rows.reshape(-1, rows.shape[-1])
    return flat.t() @ flat


def matrix_grad(module: nn.Linear | nn.Conv2d) -> torch.Tensor:
    """``∇W`` as (out, in [+1]): the weight's gradient flattened, the bias's as a last column."""
    weight = module.weight.grad
    assert weight is not None
    grad = weight.reshape(weight.shape[0], -1).float()
    if module.bias is not None:
        assert module.bias.grad is not None
        grad = torch.cat([grad, module.bias.grad.reshape(-1, 1).float()], dim=1)
    return grad


def _set_matrix_grad(module: nn.Linear | nn.Conv2d, grad: torch.Tensor) -> None:
    weight = module.weight.grad
    assert weight is not None
    columns = weight[0].numel()
    weight.copy_(grad[:, :columns].reshape(weight.shape))
    if module.bias is not None and module.bias.grad is not None:
        module.bias.grad.copy_(grad[:, columns])


def precondition(grad: torch.Tensor, eigen: Mapping[str, torch.Tensor], damping: float) -> torch.Tensor:
    """``(G + λI)⁻¹ ∇W (A + λI)⁻¹`` from the factors' eigendecompositions."""
    qa, da, qg, dg = eigen["qa"], eigen["da"], eigen["qg"], eigen["dg"]
    inner = qg.t() @ grad @ qa
    return qg @ (inner / torch.outer(dg + damping, da + damping)) @ qa.t()


def _eigen(factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    values, vectors = torch.linalg.eigh(factor)
    return values.clamp(min=0.0), vectors


class KFACPreconditioner:
    """K-FAC for the ``Linear`` and ``Conv2d`` modules of ``model``; call :meth:`step` after the backward
    (and the gradient reduction) and before ``optimizer.step()``.

    ``lr`` is the optimizer's learning rate (a number, or a function of the steps taken): KL clipping uses it.
    ``groups`` maps a module's name to the ranks of its group (default: every preconditionable module, on
    ``(0,)``); modules not in it keep their plain gradient. ``grad_scaler`` returns the loss scale of a
    ``GradScaler`` (the output gradients are divided by it; call :meth:`step` after ``scaler.unscale_``).
    """

    def __init__(self, model: nn.Module, options: KfacOptions | None = None, *, lr: Rate = 0.1,
                 groups: Mapping[str, tuple[int, ...]] | None = None, collectives: Collectives | None = None,
                 grad_scaler: Callable[[], float] | None = None) -> None:
        self.options = options or KfacOptions()
        self._lr = lr
        self.last_step_s: dict[str, float] = {}
        """Seconds of the last :meth:`step`'s parts: ``factors`` (all-reduce and running averages), ``inverses``
        (eigendecompositions) and ``precondition`` (with its broadcast and KL clipping)."""
        self.steps = 0
        self._comm: Collectives = collectives or Alone()
        self._grad_scaler = grad_scaler
        modules = dict(model.named_modules())
        chosen = groups if groups is not None else {n: (0,) for n, m in modules.items() if preconditionable(m)}
        self._layers: dict[str, _Layer] = {}
        turns: dict[tuple[int, ...], int] = {}
        for name in sorted(chosen, key=list(modules).index):
            module = modules.get(name)
            if module is None or not preconditionable(module):
                raise DeeppoolError(f"K-FAC cannot precondition module '{name}': only Linear and Conv2d (one group)")
            ranks = tuple(chosen[name])
            turn = turns.get(ranks, 0)
            turns[ranks] = turn + 1
            self._layers[name] = _Layer(name=name, module=module, ranks=ranks, owner=ranks[turn % len(ranks)])
        self._handles = [h for name, layer in self._layers.items() for h in self._hook(name, layer)]

    @property
    def layers(self) -> tuple[str, ...]:
        """The names of the preconditioned modules, in the model's order."""
        return tuple(self._layers)

    def owner(self, name: str) -> int:
        """The rank that eigendecomposes ``name``'s factors and preconditions its gradient."""
        return self._layers[name].owner

    def factors(self, name: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(A, G)`` of module ``name`` (running averages; None before the first update)."""
        layer = self._layers[name]
        return layer.a_factor, layer.g_factor

    def _collecting(self) -> bool:
        return torch.is_grad_enabled() and self.steps % self.options.factor_update_steps == 0

    def _hook(self, name: str, layer: _Layer) -> Iterator[torch.utils.hooks.RemovableHandle]:
        def forward(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
            if not (module.training and self._collecting() and output.requires_grad):
                return
            inputs = layer_inputs(layer.module, args[0])
            output.register_hook(lambda grad: backward(inputs, grad))

        def backward(inputs: torch.Tensor, grad: torch.Tensor) -> None:
            """A forward counts once its backward has run (a forward whose output is not trained is left out)."""
            rows = layer_output_grads(layer.module, grad)
            if self._grad_scaler is not None:
                rows = rows / self._grad_scaler()
            layer.sum_a = _add(layer.sum_a, _gram(inputs))
            layer.sum_g = _add(layer.sum_g, _gram(rows))
            layer.rows += inputs.shape[0]
            layer.positions = inputs.shape[1]

        yield layer.module.register_forward_hook(forward)

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def discard(self) -> None:
        """Forget this step's statistics without a step (one the optimizer skips: an fp16 overflow)."""
        for layer in self._layers.values():
            layer.sum_a, layer.sum_g, layer.rows = None, None, 0

    def step(self) -> None:
        """Update the factors and eigendecompositions when due, and replace each preconditioned module's
        ``.grad`` by its preconditioned gradient (KL-clipped)."""
        started = time.perf_counter()
        if self.steps % self.options.factor_update_steps == 0:
            for layer in self._layers.values():
                self._update_factors(layer)
        factored = time.perf_counter()
        if self.steps % self.options.inv_update_steps == 0:
            for layer in self._layers.values():
                if layer.owner == self._comm.rank and layer.a_factor is not None and layer.g_factor is not None:
                    (layer.eigen["da"], layer.eigen["qa"]), (layer.eigen["dg"], layer.eigen["qg"]) = (
                        _eigen(layer.a_factor), _eigen(layer.g_factor))
        inverted = time.perf_counter()
        damping = self.options.damping
        updates = {name: self._preconditioned(layer, damping) for name, layer in self._layers.items()}
        scale = self._kl_scale(updates)
        for name, update in updates.items():
            if update is not None:
                _set_matrix_grad(self._layers[name].module, update * scale)
        self.steps += 1
        self.last_step_s = {"factors": factored - started, "inverses": inverted - factored,
                            "precondition": time.perf_counter() - inverted}

    def _update_factors(self, layer: _Layer) -> None:
        if layer.sum_a is None or layer.sum_g is None:
            raise DeeppoolError(
                f"K-FAC saw no forward and backward of module '{layer.name}' this step: call step() "
                "once per optimizer step, after the backward"
            )
        packed = torch.cat([layer.sum_a.flatten(), layer.sum_g.flatten(), layer.sum_a.new_tensor([layer.rows])])
        if len(layer.ranks) > 1:
            self._comm.all_reduce(packed, layer.ranks)
        size_a, size_g = layer.sum_a.numel(), layer.sum_g.numel()
        rows = packed[-1]
        new_a = (packed[:size_a] / rows).reshape(layer.sum_a.shape)
        new_g = (packed[size_a:size_a + size_g] * (rows / layer.positions)).reshape(layer.sum_g.shape)
        decay = self.options.factor_decay
        layer.a_factor = new_a if layer.a_factor is None else decay * layer.a_factor + (1 - decay) * new_a
        layer.g_factor = new_g if layer.g_factor is None else decay * layer.g_factor + (1 - decay) * new_g
        layer.sum_a, layer.sum_g, layer.rows = None, None, 0

    def _preconditioned(self, layer: _Layer, damping: float) -> torch.Tensor | None:
        if layer.module.weight.grad is None:
            return None
        grad = matrix_grad(layer.module)
        if layer.owner == self._comm.rank:
            update = precondition(grad, layer.eigen, damping)
        else:
            update = torch.zeros_like(grad)
        if len(layer.ranks) > 1:
            self._comm.all_reduce(update, layer.ranks)
        return update

    def _kl_scale(self, updates: Mapping[str, torch.Tensor | None]) -> float:
        if self.options.kl_clip is None:
            return 1.0
        lr = _value(self._lr, self.steps)
        nu = 0.0
        if self._comm.rank == 0:
            total = sum(float((update * matrix_grad(self._layers[name].module)).sum()) * lr ** 2
                        for name, update in updates.items() if update is not None)
            nu = 1.0 if total == 0 else min(1.0, math.sqrt(self.options.kl_clip / abs(total)))
        return self._comm.all_reduce_max(nu)

    def state_dict(self) -> dict[str, Any]:
        """The step count and, per module, its factors and the eigendecompositions this rank holds."""
        layers = {
            name: {"a": layer.a_factor, "g": layer.g_factor, **{k: v.clone() for k, v in layer.eigen.items()}}
            for name, layer in self._layers.items()
        }
        return {"steps": self.steps, "layers": {n: {k: _clone(v) for k, v in s.items()} for n, s in layers.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if set(state["layers"]) != set(self._layers):
            raise DeeppoolError(
                f"K-FAC state is for modules {sorted(state['layers'])}, this preconditioner has {sorted(self._layers)}"
            )
        self.steps = int(state["steps"])
        for name, saved in state["layers"].items():
            layer = self._layers[name]
            layer.a_factor, layer.g_factor = _clone(saved["a"]), _clone(saved["g"])
            layer.eigen = {k: _clone(v) for k, v in saved.items() if k not in ("a", "g")}


def _add(total: torch.Tensor | None, part: torch.Tensor) -> torch.Tensor:
    return part if total is None else total + part


def _clone(value: torch.Tensor | None) -> torch.Tensor | None:
    return None if value is None else value.detach().clone()


def _value(rate: Rate, steps: int) -> float:
    return float(rate(steps)) if callable(rate) else float(rate)
