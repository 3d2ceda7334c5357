"""Which layers K-FAC preconditions, and the sizes of their Kronecker factors, from the traced graph.

The executor preconditions each ``Linear`` and ``Conv2d`` module the model calls once
(:mod:`deeppool.executor.engine.kfac_groups`); here a layer is such a module when its op is one of those and
no other layer has its target. Its factors are ``A`` (``a × a``, ``a`` the weight's columns plus the bias's:
the parameter count over the outputs) and ``G`` (``o × o``, ``o`` the output channels), over ``L`` positions
per sample (a convolution's output pixels; 1 for a ``Linear`` on vectors).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from deeppool.model.graph import Layer, LayerGraph
from deeppool.plans.enums import FLOAT_BYTES

PRECONDITIONED_OPS = ("Linear", "Conv2d")
EIGH_FLOPS = 30.0
"""A symmetric eigendecomposition of ``d × d`` priced as ``EIGH_FLOPS · d³`` FLOPs at the layer's own matmul
rate (LAPACK's ``syevd`` is ~9 d³ FLOPs but runs at a fraction of a matmul's rate; on this project's CPU
host the time of ``torch.linalg.eigh`` at d = 65 and 129 equals 28-34 d³ FLOPs of a 128-row matmul)."""

KFAC_CALLS = (12, 4, 12)
"""Tensor calls K-FAC makes per layer for its statistics (forward and backward hooks, the update), its
eigendecompositions and its preconditioning (:mod:`deeppool.adaptation.kfac`), counted from the code."""


@dataclass(frozen=True)
class FactorSizes:
    inputs: int
    """``a``: the weight's columns (``C_in·k·k`` for a convolution), plus one for the bias."""
    outputs: int
    """``o``: output features or channels."""
    positions: int
    """``L``: output positions per sample."""


def preconditioned_layers(graph: LayerGraph) -> dict[str, FactorSizes]:
    """Layer name -> its factor sizes, for the layers K-FAC preconditions, in model order."""
    targets = Counter(layer.target for layer in graph.layers)
    return {layer.name: _sizes(layer) for layer in graph.layers
            if layer.op in PRECONDITIONED_OPS and targets[layer.target] == 1 and layer.param_bytes > 0
            and layer.output_shape}


def _sizes(layer: Layer) -> FactorSizes:
    outputs = layer.output_shape[0] if layer.op == "Conv2d" else layer.output_shape[-1]
    count = layer.param_bytes // FLOAT_BYTES.get(layer.dtype, 4)
    return FactorSizes(inputs=max(1, count // outputs), outputs=outputs,
                       positions=max(1, math.prod(layer.output_shape) // outputs))
