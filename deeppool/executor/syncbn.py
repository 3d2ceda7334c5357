"""Batch normalisation synchronised inside a layer's rank group.

A layer that runs on ``g > 1`` ranks sees only its slice of the global batch,
so its BatchNorm must take mean and variance over the whole batch to give the
single-process result. :class:`GroupBatchNorm` all-reduces the per-channel
count, sum and sum of squares (in float64) over the group in the forward, and
the per-channel sums of ``dy`` and ``dy·x̂`` in the backward:

    dx = γ/σ · (dy − Σdy/N − x̂ · Σ(dy·x̂)/N),   dγ = Σ_local dy·x̂,   dβ = Σ_local dy

(``dγ``/``dβ`` stay local sums; the layer's gradient all-reduce adds them up).
Running statistics are updated with the global mean and unbiased variance, so
every rank keeps the single-process buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

Reduce = Callable[[torch.Tensor], None]
"""Sums a tensor in place over the layer's group."""


class _GroupBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
        eps: float, reduce: Reduce, stats_out: list[torch.Tensor],
    ) -> torch.Tensor:
        dims = [0, *range(2, x.dim())]
        x64 = x.double()
        count = torch.full((1,), x.numel() / x.shape[1], dtype=torch.float64, device=x.device)
        stats = torch.cat([count, x64.sum(dims), x64.square().sum(dims)])
        reduce(stats)
        channels = x.shape[1]
        total, mean = stats[0], stats[1 : 1 + channels] / stats[0]
        var = (stats[1 + channels :] / total - mean.square()).clamp_min(0)
        stats_out.extend([mean, var, total])
        shape = [1, channels] + [1] * (x.dim() - 2)
        invstd = (var + eps).rsqrt().to(x.dtype).view(shape)
        xhat = (x - mean.to(x.dtype).view(shape)) * invstd
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.reduce, ctx.total, ctx.dims = reduce, float(total), dims
        out = xhat
        if weight is not None:
            out = out * weight.view(shape)
        if bias is not None:
            out = out + bias.view(shape)
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        xhat, invstd, weight = ctx.saved_tensors
        shape = invstd.shape
        sum_dy = dy.sum(ctx.dims)
        sum_dy_xhat = (dy * xhat).sum(ctx.dims)
        both = torch.cat([sum_dy, sum_dy_xhat]).double()
        ctx.reduce(both)
        channels = sum_dy.numel()
        mean_dy = (both[:channels] / ctx.total).to(dy.dtype).view(shape)
        mean_dy_xhat = (both[channels:] / ctx.total).to(dy.dtype).view(shape)
        scale = invstd if weight is None else invstd * weight.view(shape)
        dx = scale * (dy - mean_dy - xhat * mean_dy_xhat)
        dweight = sum_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        dbias = sum_dy if ctx.needs_input_grad[2] else None
        return dx, dweight, dbias, None, None, None


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
        stats: list[torch.Tensor] = []
        out = _GroupBatchNormFn.apply(x, bn.weight, bn.bias, bn.eps, self._reduce, stats)
        if bn.track_running_stats and bn.running_mean is not None and bn.running_var is not None:
            self._update_running(bn, *stats)
        return out

    @staticmethod
    def _update_running(
        bn: nn.modules.batchnorm._BatchNorm, mean: torch.Tensor, var: torch.Tensor, total: torch.Tensor
    ) -> None:
        assert bn.num_batches_tracked is not None and bn.running_mean is not None and bn.running_var is not None
        with torch.no_grad():
            bn.num_batches_tracked.add_(1)
            momentum = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
            unbiased = var * (total / (total - 1)) if float(total) > 1 else var
            bn.running_mean.mul_(1 - momentum).add_(mean.to(bn.running_mean.dtype), alpha=momentum)
            bn.running_var.mul_(1 - momentum).add_(unbiased.to(bn.running_var.dtype), alpha=momentum)
