"""What a layer holding BatchNorm computes on ``g > 1`` ranks, measured.

A layer on several ranks runs its BatchNorm as :class:`~deeppool.model.syncbn.GroupBatchNorm` (statistics
over the group's whole batch, in float64, bit for bit the single-process result), not PyTorch's fused
kernel that the profiler's in-context passes time. Its own arithmetic (float64 sums, several passes over
the activations) can take several times the fused kernel's, beside the collectives the cost model prices
apart (``BN_l(g)``). So a plan must price it as it runs: for every layer that normalises the batch, the profiler
times the layer standalone both ways, alternating (fused, then grouped with the sum over one rank, which is
the identity), and scales the layer's in-context times by the ratios of the medians. Timing both the same
way, side by side, keeps the ratio free of the machine's load; the in-context time keeps what the layer
costs among the others.
"""

from __future__ import annotations

import copy
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import fx

from deeppool.model.batching import normalises_batch
from deeppool.model.graph import Layer, LayerGraph, grad_flows
from deeppool.model.layer_exec import CompiledLayerRunner, LayerRunner, floating_leaves, run_at
from deeppool.model.syncbn import sync_batch_norms

Timer = Callable[[Callable[[], object]], tuple[float, object]]
"""Milliseconds a piece of work takes on the profiling device, and its result."""
REPEATS = 7
"""Timed repeats of each way, after one untimed; the ratio is of the medians."""


@dataclass(frozen=True, kw_only=True)
class Ratio:
    """Grouped over fused time of one layer's forward and backward."""

    fwd: float
    bwd: float


@dataclass(frozen=True, kw_only=True)
class GroupedLayers:
    """The layers that normalise the batch, each runnable fused (as the profile measured it) and grouped."""

    graph: LayerGraph
    runners: dict[str, LayerRunner]
    """Every layer's runner on the model as the profiler runs it (fused BatchNorm)."""
    grouped: dict[str, LayerRunner]
    """The batch-normalising layers' runners on a copy whose BatchNorm runs grouped."""
    module: torch.nn.Module
    """The copy: its gradients are dropped after each measurement."""

    @classmethod
    def of(cls, module: fx.GraphModule, graph: LayerGraph, runners: dict[str, LayerRunner]) -> GroupedLayers:
        """A copy of ``module`` whose batch-normalising layers run grouped (the executor's swap, with the
        one-rank sum); none when no layer normalises the batch."""
        layers = [layer for layer in graph.layers if normalises_batch(module, layer)]
        copied = copy.deepcopy(module) if layers else module
        for layer in layers:
            sync_batch_norms(copied, layer, _one_rank)
        grouped = {layer.name: CompiledLayerRunner(copied, layer) for layer in layers}
        return cls(graph=graph, runners=runners, grouped=grouped, module=copied)

    def ratios(self, inputs: dict[str, torch.Tensor], batch: int, timed: Timer,
               code: Mapping[str, str]) -> dict[str, Ratio]:
        """Every grouped layer's ratio at per-GPU ``batch``, on its arguments in one forward of ``inputs``.

        ``code`` is each layer's code without its submodules' paths: a layer alike in it and in its arguments
        (shapes, dtypes, which take gradients) to one measured before takes that one's ratio, as ResNet-50's
        53 BatchNorm layers have 12 kinds."""
        if not self.grouped:
            return {}
        flows = self._flows
        found: dict[str, Ratio] = {}
        by_kind: dict[tuple[object, ...], Ratio] = {}
        for layer, args in self._arguments(inputs, batch):
            leaves = [a.detach().requires_grad_(flows.get(name, False) and a.is_floating_point())
                      if isinstance(a, torch.Tensor) else a for name, a in zip(layer.inputs, args, strict=True)]
            kind = (code[layer.name], *(_described(leaf) for leaf in leaves))
            if kind not in by_kind:
                fused = _medians(self.runners[layer.name], leaves, batch, timed)
                grouped = _medians(self.grouped[layer.name], leaves, batch, timed)
                by_kind[kind] = Ratio(fwd=_ratio(grouped[0], fused[0]), bwd=_ratio(grouped[1], fused[1]))
            found[layer.name] = by_kind[kind]
        for param in self.module.parameters():
            param.grad = None  # the grouped runs' (the profiler drops the fused runs' after measuring)
        return found

    @cached_property
    def _flows(self) -> dict[str, bool]:
        return grad_flows(self.graph)

    def _arguments(self, inputs: dict[str, torch.Tensor], batch: int) -> list[tuple[Layer, list[object]]]:
        """Each grouped layer and its arguments, from one untimed forward of the whole model."""
        values: dict[str, object] = dict(inputs)
        found = []
        with torch.no_grad():
            for layer in self.graph.layers:
                args = [values[name] for name in layer.inputs]
                if layer.name in self.grouped:
                    found.append((layer, args))
                values[layer.name] = run_at(self.runners[layer.name], args, batch)
        return found


def _one_rank(_: torch.Tensor) -> None:
    """The sum over a group of one rank: the tensor as it is."""


def _described(value: object) -> object:
    """What of an argument a layer's time depends on: a tensor's shape, dtype and whether it takes gradients."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), str(value.dtype), value.requires_grad
    return repr(value)


def _ratio(grouped: float, fused: float) -> float:
    return grouped / fused if fused > 0 else 1.0


def _medians(runner: LayerRunner, args: list[object], batch: int, timed: Timer) -> tuple[float, float]:
    """Median forward and backward ms of ``runner`` on ``args`` standalone (one untimed run first)."""
    fwd, bwd = [], []
    for repeat in range(REPEATS + 1):
        forward_ms, value = timed(lambda: run_at(runner, args, batch))
        outputs = floating_leaves(value)
        backward_ms = timed(lambda o=outputs: torch.autograd.backward(o, [torch.ones_like(t) for t in o]))[0] \
            if outputs else 0.0
        if repeat:
            fwd.append(forward_ms)
            bwd.append(backward_ms)
    return statistics.median(fwd), statistics.median(bwd)
