"""Mixed precision as the user writes it: their ``torch.autocast`` around ``step``, their ``GradScaler``.

**Autocast.** The engine runs a stage's forward inside whatever autocast the user's ``with
torch.autocast(...)`` opened; a reshard's receive buffer must then have the dtype the producing layer
outputs under that autocast, not its traced fp32. :class:`UserPrecision` reads the autocast state at
each reshard; every layer's output dtype under bf16 and fp16 autocast is computed once, before the rank
drops the layers it does not run (:func:`~deeppool.executor.engine.precision.output_dtypes`, on fake tensors).

**GradScaler.** ``bp.step(..., scaler=scaler)`` starts the backward from ``scaler.scale(loss)``; the
user then calls ``scaler.step(opt)`` and ``scaler.update()`` unchanged. Those look for an inf or NaN
in *this rank's* gradients only; under data parallelism the gradient all-reduce spreads one rank's
overflow to every rank, but a burst plan holds parameters on groups of different sizes, and a layer
that overflowed on rank 0 alone is never seen by rank 3. So after the reduction every rank says
whether it holds a non-finite gradient (in the same all-reduce as the global loss), and a rank whose
gradients are finite while some rank's are not sets one of its gradient elements to inf: its scaler
then skips the step and backs off exactly as every other rank's does, as the executor's
:class:`~deeppool.executor.engine.precision.AgreedScaler` agrees.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx

from deeppool.errors import DeeppoolError
from deeppool.executor.engine.precision import MixedPrecision, output_dtypes
from deeppool.model.graph import LayerGraph
from deeppool.plans import Precision

_PRECISIONS = {torch.bfloat16: Precision.BF16, torch.float16: Precision.FP16}


class UserPrecision(MixedPrecision):
    """The engine's precision under the user's own autocast and GradScaler."""

    def __init__(self, tables: Mapping[torch.dtype, Mapping[str, torch.dtype] | str], device: torch.device) -> None:
        super().__init__(Precision.FP32, device, {}, None)
        self._tables = dict(tables)
        self.loss_scaler: torch.amp.GradScaler | None = None
        """The GradScaler of the step being run (None: the loss is not scaled)."""

    @classmethod
    def measured(cls, module: fx.GraphModule, graph: LayerGraph, named: Mapping[str, Any],
                 device: torch.device) -> UserPrecision:
        """Each layer's output dtype under every autocast dtype (why it cannot run, for one that fails)."""
        tables: dict[torch.dtype, Mapping[str, torch.dtype] | str] = {}
        for dtype, precision in _PRECISIONS.items():
            try:
                tables[dtype] = output_dtypes(module, graph, named, precision, device)
            except Exception as err:  # noqa: BLE001 - said when the user autocasts to this dtype
                tables[dtype] = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        return cls(tables, device)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # the user's autocast, if any, is already open

    def dtype(self, layer: str, traced: torch.dtype) -> torch.dtype:
        kind = self._device.type
        if not torch.is_autocast_enabled(kind):
            return traced
        dtype = torch.get_autocast_dtype(kind)
        table = self._tables.get(dtype, f"autocast to {dtype} is not supported (bfloat16 or float16)")
        if isinstance(table, str):
            raise DeeppoolError(f"this model cannot run under torch.autocast({kind!r}, dtype={dtype}): {table}")
        return table.get(layer, traced)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.loss_scaler is None else self.loss_scaler.scale(loss)


def non_finite(grads: Sequence[torch.Tensor]) -> bool:
    """Whether any of ``grads`` holds an inf or NaN (one wait for the device)."""
    if not grads:
        return False
    return bool(torch.stack([torch.logical_not(torch.isfinite(g).all()) for g in grads]).any())


def spread_overflow(grads: Sequence[torch.Tensor]) -> None:
    """Make this rank's GradScaler see the overflow another rank found: one gradient element becomes inf."""
    if grads:
        grads[0].view(-1)[0] = float("inf")
