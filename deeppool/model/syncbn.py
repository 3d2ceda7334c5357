"""Batch normalisation synchronised inside a layer's rank group.

A layer that runs on ``g > 1`` ranks sees only its slice of the global batch,
so its BatchNorm must take mean and variance over the whole batch to give the
single-process result. :class:`GroupBatchNorm` all-reduces (in float64) the
per-channel count and sum, then the sum of squared deviations from the
global mean, in the forward; and the per-channel sums of ``dy`` and
``dy·(x − μ)`` in the backward:

    dx = γ·σ⁻¹ · (dy − Σdy/N − (x − μ) · σ⁻² · Σ(dy·(x − μ))/N)
    dγ = σ⁻¹ · Σ_local dy·(x − μ),   dβ = Σ_local dy

(``dγ``/``dβ`` stay local sums; the layer's gradient all-reduce adds them up).

**Same arithmetic as single-process BatchNorm.** The forward reproduces
PyTorch's CPU kernel step by step — ``μ = float(Σx / N)`` with a float64 sum,
``var = float(Σ float((x − μ)²)) / N`` (two passes, the squares in the input
dtype), ``σ⁻¹ = float(1 / √(var + ε))`` in float64, ``y = x·α + β`` with
``α = σ⁻¹γ`` and ``β = β₀ − μα`` each rounded once (fused multiply-add) — so
for contiguous inputs with spatial dimensions it is bit-for-bit the output of
``nn.BatchNorm`` on the whole batch. This matters: a deep ReLU network
amplifies a one-ulp difference in a normalised activation into a different
ReLU mask and an O(1) relative difference in some gradients, so matching the
reference to round-off needs the forward to be the reference's forward. Inputs without
spatial dimensions (BatchNorm1d on ``[N, C]``), which PyTorch reduces with
thread-dependent float partial sums, match to round-off instead.

Running statistics are updated with the global mean and unbiased variance, so
every rank keeps the single-process buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx, nn

from deeppool.errors import DeeppoolError
from deeppool.model.graph import Layer

Reduce = Callable[[torch.Tensor], None]
"""Sums a tensor in place over the layer's group."""


def _dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _channel_view(x: torch.Tensor) -> list[int]:
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def group_moments(x: torch.Tensor, reduce: Reduce) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Global per-channel mean and biased variance (input dtype) and the global count.

    Two reductions, as PyTorch's CPU kernel computes them: the mean from a
    float64 sum, then the sum of squared deviations from that (rounded) mean.
    """
    dims, view = _dims(x), _channel_view(x)
    first = torch.cat([torch.tensor([x.numel() // x.shape[1]], dtype=torch.float64, device=x.device),
                       x.sum(dims, dtype=torch.float64)])
    reduce(first)
    count = int(first[0])
    mean = (first[1:] / count).to(x.dtype)
    var_sum = torch.sub(x, mean.view(view)).square_().sum(dims, dtype=torch.float64)
    reduce(var_sum)
    return mean, var_sum.to(x.dtype) / count, count


class _GroupBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
        eps: float, reduce: Reduce, stats_out: list[Any],
    ) -> torch.Tensor:
        mean, var, count = group_moments(x, reduce)
        stats_out.extend([mean, var, count])
        invstd = (1.0 / torch.sqrt(var.double() + eps)).to(x.dtype)
        alpha = invstd if weight is None else invstd * weight
        offset = torch.zeros_like(mean) if bias is None else bias
        beta = (offset.double() - mean.double() * alpha.double()).to(x.dtype)  # one rounding, as an FMA
        view = _channel_view(x)
        ctx.save_for_backward(x, mean, invstd, weight)
        ctx.reduce, ctx.count = reduce, count
        return torch.addcmul(beta.view(view), x, alpha.view(view))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, mean, invstd, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dweight, dbias = _local_grads(dy, x, mean, invstd, weight)
        sums = torch.cat([dbias.double(), dweight.double() / invstd.double()])
        ctx.reduce(sums)
        dx = _input_grad(dy, x, mean, invstd, weight, sums, ctx.count)
        return (dx, dweight if weight is not None and ctx.needs_input_grad[1] else None,
                dbias if ctx.needs_input_grad[2] else None, None, None, None)


def _local_grads(
    dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor, weight: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``dγ = σ⁻¹·Σ dy·(x − μ)`` and ``dβ = Σ dy`` (float64 sums), in the parameters' dtype.

    PyTorch's fused kernel takes one pass when input and parameters share a dtype; otherwise (e.g. bf16
    activations with fp32 parameters) two reductions in float64.
    """
    if weight is None or weight.dtype == x.dtype:
        ones = torch.ones_like(mean) if weight is None else weight
        _, dweight, dbias = torch.ops.aten.native_batch_norm_backward(
            dy, x, ones, None, None, mean, invstd, True, 0.0, [False, True, True])
        return dweight, dbias
    dims, view = _dims(x), _channel_view(x)
    dotp = (torch.sub(x, mean.view(view)) * dy).sum(dims, dtype=torch.float64)
    return (dotp * invstd.double()).to(weight.dtype), dy.sum(dims, dtype=torch.float64).to(weight.dtype)


def _input_grad(
    dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor, weight: torch.Tensor | None,
    sums: torch.Tensor, count: int,
) -> torch.Tensor:
    """``dx = a·dy − a·k·(x − μ) − a·Σdy/N`` with ``a = γσ⁻¹``, ``k = σ⁻²·Σ dy·(x − μ)/N`` (global sums):
    three passes (``x − μ``, then two fused multiply-adds)."""
    channels, view = mean.numel(), _channel_view(x)
    scale = invstd if weight is None else invstd * weight
    k = (sums[channels:] / count).to(x.dtype) * invstd * invstd
    shift = -(sums[:channels] / count).to(x.dtype) * scale
    dx = torch.addcmul(shift.view(view), torch.sub(x, mean.view(view)), (-scale * k).view(view))
    return dx.addcmul_(dy, scale.view(view)).to(x.dtype)


class GroupBatchNorm(nn.Module):
    """Stands in for a ``_BatchNorm`` module, sharing its parameters and buffers.

    The original module is held outside the module tree, so parameter names of
    the traced model do not change when it is swapped in.
    """

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, reduce: Reduce) -> None:
        super().__init__()
        self._held = (bn,)
        self._reduce = reduce

    @property
    def bn(self) -> nn.modules.batchnorm._BatchNorm:
        return self._held[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn = self.bn
        if not bn.training:
            return bn(x)
        out, stats = _group_normalise(x, bn.weight, bn.bias, bn.eps, self._reduce)
        if bn.track_running_stats and bn.running_mean is not None and bn.running_var is not None:
            self._update_running(bn, *stats)
        return out

    @staticmethod
    def _update_running(bn: nn.modules.batchnorm._BatchNorm, mean: torch.Tensor, var: torch.Tensor, count: int) -> None:
        assert bn.num_batches_tracked is not None and bn.running_mean is not None and bn.running_var is not None
        with torch.no_grad():
            bn.num_batches_tracked.add_(1)
        momentum = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
        update_running(bn.running_mean, bn.running_var, momentum, mean, var, count)


class FunctionalGroupBatchNorm(nn.Module):
    """Stands in for a ``torch.batch_norm`` call of an exported graph (``aten.batch_norm``), same arguments.

    The graph updates ``num_batches_tracked`` in a node of its own; the momentum is an argument.
    """

    def __init__(self, reduce: Reduce) -> None:
        super().__init__()
        self._reduce = reduce

    def forward(  # aten.batch_norm's signature
        self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
        running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool, momentum: float,
        eps: float, cudnn_enabled: bool,
    ) -> torch.Tensor:
        if not training:
            return torch.batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled)
        out, stats = _group_normalise(x, weight, bias, eps, self._reduce)
        if running_mean is not None and running_var is not None:
            update_running(running_mean, running_var, momentum, *stats)
        return out


def _group_normalise(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, reduce: Reduce,
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, int]]:
    """The normalised ``x`` over the group's whole batch, and the batch's mean, variance and count."""
    stats: list[Any] = []
    # bf16/fp16 (autocast): computed in fp32 and rounded once, as PyTorch's kernel does with its opmath type
    wide = x.float() if x.dtype in (torch.bfloat16, torch.float16) else x
    out = _GroupBatchNormFn.apply(wide.contiguous(), weight, bias, eps, reduce, stats)
    mean, var, count = stats
    return out.to(x.dtype), (mean, var, count)


def update_running(
    running_mean: torch.Tensor, running_var: torch.Tensor, momentum: float, mean: torch.Tensor, var: torch.Tensor,
    count: int,
) -> None:
    """The running statistics updated with the global mean and unbiased variance, as ``nn.BatchNorm`` does."""
    with torch.no_grad():
        unbiased = var * (count / (count - 1)) if count > 1 else var
        running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)


def sync_batch_norms(module: fx.GraphModule, layer: Layer, reduce: Reduce) -> None:
    """Swap ``layer``'s BatchNorm modules and ``torch.batch_norm`` calls in ``module`` for their group versions
    summing with ``reduce`` (what a layer on ``g > 1`` ranks runs); another batch-norm call is refused."""
    by_name = {node.name: node for node in module.graph.nodes}
    for node_name in layer.nodes:
        node = by_name[node_name]
        if node.op == "call_module":
            target = str(node.target)
            sub = module.get_submodule(target)
            if isinstance(sub, nn.modules.batchnorm._BatchNorm):
                _replace(module, target, GroupBatchNorm(sub, reduce))
        elif node.op == "call_function" and node.target is torch.ops.aten.batch_norm.default:
            _call_module(module, node, FunctionalGroupBatchNorm(reduce))
        elif node.op == "call_function" and "batch_norm" in getattr(node.target, "__name__", str(node.target)):
            raise DeeppoolError(
                f"layer '{layer.name}' calls {getattr(node.target, '__name__', node.target)} on several ranks; "
                "the executor synchronises nn.BatchNorm modules and torch.batch_norm: give this layer 1 GPU"
            )


def _call_module(module: fx.GraphModule, node: fx.Node, new: nn.Module) -> None:
    """Turn a function call node into a call of ``new`` (same arguments), held by ``module``."""
    name = f"deeppool_{node.name}"
    module.add_submodule(name, new)
    node.op, node.target = "call_module", name


def _replace(module: nn.Module, target: str, new: nn.Module) -> None:
    parent_path, _, leaf = target.rpartition(".")
    parent = module.get_submodule(parent_path) if parent_path else module
    setattr(parent, leaf, new)
