"""Mixed precision (``--precision bf16|fp16``): autocast forwards, the dtypes it gives reshards, and
fp16 loss scaling whose skip decision every rank shares.

**Autocast.** Each stage's forward and the loss run under ``torch.autocast(device_type, dtype)``;
parameters, their gradients and the optimizer stay fp32 (master weights), as in single-process
``torch.autocast`` training. A stage's outputs then have the dtype autocast gives them (a Linear's
bf16, a softmax's fp32...), which is not the traced (fp32) dtype, so a reshard's receive buffer
and the buffer for its gradient take the dtype the producing layer really outputs:
:func:`output_dtypes` runs the whole traced model once under autocast on fake tensors
(``FakeTensorMode``: no compute, no data, parameters and buffers untouched) and records each
layer's output dtype.

**Loss scaling (fp16).** As ``torch.amp.GradScaler``: the backward starts from ``loss · s``
(``s`` the scale, a power of two by default, so scaling is exact), the reduced gradients are
multiplied by ``1/s`` (fp32, as GradScaler's ``inv_scale``) before clipping and the step, and a
step whose gradients hold an inf or NaN is skipped, after which ``s ← s · backoff``; after
``interval`` steps in a row without one, ``s ← s · growth``. A burst plan spreads the parameters
over groups of different sizes, so one rank's gradients can overflow where another's do not:
:class:`AgreedScaler` takes the maximum of every rank's found-inf flag over the whole world (one
all-ranks collective per step), so every rank skips the same steps and keeps the same scale.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode

from deeppool.executor.config import LossScaling
from deeppool.executor.engine.comm import Comm
from deeppool.model.graph import LayerGraph
from deeppool.plans import Precision

DTYPES = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}


def autocast(precision: Precision, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` to the precision's dtype on the device's type; nothing for fp32."""
    if precision is Precision.FP32:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=DTYPES[precision])


def output_dtypes(
    module: fx.GraphModule, graph: LayerGraph, named: Mapping[str, Any], precision: Precision, device: torch.device
) -> dict[str, torch.dtype]:
    """Each layer's output dtype under ``precision``: the traced model run once on fake tensors.

    ``named`` are example inputs by ``forward``'s argument names (two samples are enough).
    """
    if precision is Precision.FP32:
        return {}
    found: dict[str, torch.dtype] = {}
    wanted = {layer.name for layer in graph.layers}
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        state = {name: mode.from_tensor(value) for name, value in _state(module)}
        args = [_fake(mode, named[key], device) for key in graph.input_keys]
        with autocast(precision, device):
            torch.func.functional_call(_Recording(module, wanted, found), state, tuple(args), strict=False)
    return found


class _Recording(torch.nn.Module):
    """Runs an fx module node by node, recording the dtype of every wanted node's tensor output."""

    def __init__(self, inner: fx.GraphModule, wanted: set[str], found: dict[str, torch.dtype]) -> None:
        super().__init__()
        self.inner = inner
        self._wanted = wanted
        self._found = found

    def forward(self, *args: Any) -> Any:
        wanted, found = self._wanted, self._found

        class _Interpreter(fx.Interpreter):
            def run_node(self, node: fx.Node) -> Any:
                value = super().run_node(node)
                if node.name in wanted and isinstance(value, torch.Tensor):
                    found[node.name] = value.dtype
                return value

        return _Interpreter(self.inner).run(*args)


def _state(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters and buffers under the names ``functional_call`` on a :class:`_Recording` takes."""
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    return [(f"inner.{name}", value) for name, value in named]


def _fake(mode: FakeTensorMode, value: Any, device: torch.device) -> Any:
    return mode.from_tensor(value).to(device) if isinstance(value, torch.Tensor) else value


class AgreedScaler:
    """fp16 dynamic loss scaling with ``torch.amp.GradScaler``'s arithmetic and one skip decision for all ranks."""

    def __init__(self, scaling: LossScaling, comm: Comm) -> None:
        self._scaling = scaling
        self._comm = comm
        self._scale = torch.full((), scaling.initial, dtype=torch.float32)
        self._tracker = 0

    @property
    def scale(self) -> float:
        return float(self._scale)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss · s`` (GradScaler's ``scale``)."""
        return loss * self._scale.to(loss.device)

    def unscale_and_agree(self, grads: Sequence[torch.Tensor]) -> bool:
        """Multiply ``grads`` by ``1/s`` in place and update the scale; True when the step must be skipped:
        some rank's gradients hold an inf or NaN (every rank calls this once per optimizer step)."""
        inverse = self._scale.double().reciprocal().float()
        flags = []
        for grad in grads:
            grad.mul_(inverse.to(grad.device))
            flags.append(torch.logical_not(torch.isfinite(grad).all()))
        local = bool(torch.stack(flags).any()) if flags else False  # one wait for the device, not one per tensor
        found = self._comm.all_reduce_max(1.0 if local else 0.0) > 0
        self._update(found)
        return found

    def _update(self, found: bool) -> None:
        """GradScaler's ``_amp_update_scale_``: back off after an overflow, grow after ``interval`` clean steps."""
        scaling = self._scaling
        if found:
            self._scale.mul_(scaling.backoff)
            self._tracker = 0
            return
        self._tracker += 1
        if self._tracker == scaling.interval:
            grown = self._scale * scaling.growth
            if bool(torch.isfinite(grown)):
                self._scale.copy_(grown)
            self._tracker = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": float(self._scale), "growth_tracker": self._tracker}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._scale.fill_(float(state["scale"]))
        self._tracker = int(state["growth_tracker"])


def grad_scaler(scaling: LossScaling, device: torch.device) -> torch.amp.GradScaler:
    """torch's own GradScaler with the same settings (the single-process reference's)."""
    return torch.amp.GradScaler(device.type, init_scale=scaling.initial, growth_factor=scaling.growth,
                                backoff_factor=scaling.backoff, growth_interval=scaling.interval)


class MixedPrecision:
    """What the engine needs for one run's precision: autocast, reshard dtypes, and the fp16 scaler."""

    def __init__(self, precision: Precision, device: torch.device, dtypes: Mapping[str, torch.dtype],
                 scaler: AgreedScaler | None) -> None:
        self.precision = precision
        self._device = device
        self._dtypes = dict(dtypes)
        self.scaler = scaler

    @classmethod
    def fp32(cls) -> MixedPrecision:
        return cls(Precision.FP32, torch.device("cpu"), {}, None)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return autocast(self.precision, self._device)

    def dtype(self, layer: str, traced: torch.dtype) -> torch.dtype:
        """The dtype ``layer`` outputs in this run (its traced dtype in fp32)."""
        return self._dtypes.get(layer, traced)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale_loss(loss)

    def unscale(self, grads: Sequence[torch.Tensor]) -> bool:
        """Unscale (fp16) and say whether every rank skips this step."""
        return False if self.scaler is None else self.scaler.unscale_and_agree(grads)
