"""K-FAC's work per layer, timed on this host (``deeppool plan --optimizer kfac`` with a profile measured here).

Each preconditioned layer is rebuilt as a stand-alone module of its kind and shape (a ``Linear`` with its
features and bias on inputs of its positions, a ``Conv2d`` with its kernel, stride, padding and dilation on an
input that gives its output size) and trained a few rounds at the global batch ``B`` by
:class:`deeppool.adaptation.kfac.KFACPreconditioner`, the class the executor runs, with factors and
eigendecompositions every step. Per round: a forward and backward without the preconditioner's hooks, one
with them, and its ``step()`` (whose own clock splits the factor update, the eigendecompositions and the
preconditioning with KL clipping). The statistics are the hooks' extra time (the unfold of a convolution,
the Gram matrices); each part is the median over the rounds, after one warm-up round
(docs/notes/0620-kfac-priced-as-it-runs.md). Layers of the same kind and shape are timed once, with
the profile's intra-op threads.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
from torch import nn

from deeppool.adaptation.kfac import KFACPreconditioner
from deeppool.adaptation.kfac_options import KfacOptions
from deeppool.errors import DeeppoolError
from deeppool.model.graph import LayerGraph
from deeppool.planner.profiling.timing import intra_op_threads

ROUNDS = 7
"""Timed rounds per layer shape (after one warm-up round); each part is their median."""


@dataclass(frozen=True)
class KfacTimes:
    """Milliseconds of one layer's K-FAC work on one rank at the global batch."""

    statistics_ms: float
    """The forward and backward hooks' work (inputs unfolded, both Gram matrices): it scales with the rows."""
    inverses_ms: float
    """Both eigendecompositions."""
    precondition_ms: float
    """The preconditioned gradient, KL clipping, and the copy back into ``.grad``."""
    factor_update_ms: float = 0.0
    """The running averages of both factors (whatever the rows)."""


@dataclass(frozen=True)
class KfacLayer:
    """A preconditioned layer as K-FAC sees it: its module's kind and hyperparameters, one sample's input shape."""

    kind: str
    """``Linear`` or ``Conv2d``."""
    inputs: int
    """Input features or channels."""
    outputs: int
    """Output features or channels."""
    bias: bool
    sample_shape: tuple[int, ...]
    """One sample's input: ``(..., inputs)`` for a ``Linear``, ``(inputs, H, W)`` for a ``Conv2d``."""
    kernel: tuple[int, int] = (1, 1)
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)

    def build(self) -> nn.Linear | nn.Conv2d:
        """A fresh module of this kind and shape, on the CPU in fp32."""
        if self.kind == "Linear":
            return nn.Linear(self.inputs, self.outputs, bias=self.bias)
        return nn.Conv2d(self.inputs, self.outputs, self.kernel, stride=self.stride, padding=self.padding,
                         dilation=self.dilation, bias=self.bias)


def kfac_layer(module: nn.Module, output_shape: tuple[int, ...]) -> KfacLayer:
    """``module``'s :class:`KfacLayer` (its parameters may be on the meta device), from one sample's output."""
    if isinstance(module, nn.Conv2d):
        kernel, stride, dilation = (_pair(v) for v in (module.kernel_size, module.stride, module.dilation))
        padding = _pair(module.padding) if isinstance(module.padding, tuple) else (0, 0)
        size = tuple(max(k, (out - 1) * s + d * (k - 1) + 1 - 2 * p) for out, k, s, p, d in
                     zip(output_shape[1:], kernel, stride, padding, dilation, strict=True))
        return KfacLayer(kind="Conv2d", inputs=module.in_channels, outputs=module.out_channels,
                         bias=module.bias is not None, sample_shape=(module.in_channels, *size), kernel=kernel,
                         stride=stride, padding=padding, dilation=dilation)
    if isinstance(module, nn.Linear):
        return KfacLayer(kind="Linear", inputs=module.in_features, outputs=module.out_features,
                         bias=module.bias is not None, sample_shape=(*output_shape[:-1], module.in_features))
    raise DeeppoolError(f"K-FAC times only Linear and Conv2d layers, not {type(module).__name__}")


def kfac_layers(graph: LayerGraph, names: tuple[str, ...], root: nn.Module) -> dict[str, KfacLayer]:
    """The :class:`KfacLayer` of each layer in ``names``, its module found in ``root`` (the traced model)."""
    by_name = {layer.name: layer for layer in graph.layers}
    return {name: kfac_layer(root.get_submodule(by_name[name].target), by_name[name].output_shape)
            for name in names}


def measure_kfac(layers: Mapping[str, KfacLayer], batch: int, options: KfacOptions | None = None, *,
                 threads: int | None = None, rounds: int = ROUNDS) -> dict[str, KfacTimes]:
    """Each layer's :class:`KfacTimes` (by layer name), timed here on the CPU with ``options``' damping and KL
    clipping (its update intervals are the cost model's to amortise)."""
    chosen = replace(options or KfacOptions(), factor_update_steps=1, inv_update_steps=1)
    found: dict[KfacLayer, KfacTimes] = {}
    with intra_op_threads(threads):
        for shape in dict.fromkeys(layers.values()):
            found[shape] = _measure(shape, batch, chosen, rounds)
    return {name: found[shape] for name, shape in layers.items()}


def _measure(shape: KfacLayer, batch: int, options: KfacOptions, rounds: int) -> KfacTimes:
    torch.manual_seed(0)
    plain, hooked = shape.build(), shape.build()
    x = torch.randn(batch, *shape.sample_shape)
    kfac = KFACPreconditioner(hooked, options, lr=0.1)
    parts: dict[str, list[float]] = {"hooks": [], "factors": [], "inverses": [], "precondition": []}
    try:
        for index in range(rounds + 1):
            bare = _passes_ms(plain, x)
            with_hooks = _passes_ms(hooked, x)
            kfac.step()
            if index == 0:
                continue
            parts["hooks"].append(with_hooks - bare)
            for name in ("factors", "inverses", "precondition"):
                parts[name].append(1e3 * kfac.last_step_s[name])
    finally:
        kfac.remove()
    median = {name: statistics.median(values) for name, values in parts.items()}
    return KfacTimes(statistics_ms=max(0.0, median["hooks"]), inverses_ms=median["inverses"],
                     precondition_ms=median["precondition"], factor_update_ms=median["factors"])


def _passes_ms(module: nn.Module, x: torch.Tensor) -> float:
    """One forward and backward of ``module`` on ``x`` (gradients set to None first, as the executor does)."""
    module.zero_grad(set_to_none=True)
    started = time.perf_counter()
    module(x).square().mean().backward()
    return 1e3 * (time.perf_counter() - started)


def _pair(value: int | tuple[int, ...]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (int(value[0]), int(value[-1]))

