"""Whole training passes of a model run layer by layer (:class:`Passes`): every layer's forward and backward
timed in context, as the executor's stages run them, and one pass chained as a one-stage executor runs it."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import cached_property

import torch

from deeppool.errors import DeeppoolError
from deeppool.model.graph import Layer, LayerGraph, grad_flows
from deeppool.model.layer_exec import LayerFailed, LayerRunner, floating_leaves, run_at
from deeppool.model.randomness import SampleRandomness
from deeppool.planner.profiling.timing import timed


@dataclass(frozen=True, kw_only=True)
class Passes:
    """Runs whole training passes of a model layer by layer, timing each layer's forward and backward."""

    module: torch.nn.Module
    graph: LayerGraph
    runners: dict[str, LayerRunner]
    device: torch.device
    random: SampleRandomness | None = None
    """The per-sample randomness mode the executor's forwards run under, for a model that draws random numbers
    (every op then passes through it, and each random op draws sample by sample): the forwards are timed
    under it too."""

    @cached_property
    def flows(self) -> dict[str, bool]:
        """Which layers' outputs take gradients (:func:`grad_flows`), once per model."""
        return grad_flows(self.graph)

    @cached_property
    def last_use(self) -> dict[str, int]:
        """By value name: the index of the last layer that reads it (a forward drops it after that layer)."""
        return {name: index for index, layer in enumerate(self.graph.layers) for name in layer.inputs}

    def drawing(self) -> AbstractContextManager[object]:
        """The context a forward runs in: the per-sample randomness mode from its first draw, or nothing."""
        return self.random.at(step=0, offset=0, ordinal=0) if self.random is not None else nullcontext()

    def run(self, inputs: dict[str, torch.Tensor], *, batch: int, keep: frozenset[str] = frozenset()
            ) -> tuple[dict[str, float], dict[str, float], dict[str, object]]:
        """One pass: every layer's forward in order, then every backward in reverse, each on its own
        leaves (as the executor's stages: inputs take gradients where :func:`grad_flows` says, the
        gradients of a layer's output summed over its consumers); (fwd_ms, bwd_ms) by layer, and the
        values of the layers in ``keep`` (each other value and gradient is dropped once its backward
        has run, so a pass holds what a training step holds). A layer whose forward or backward raises at
        this per-GPU ``batch`` is a :class:`LayerFailed` naming it."""
        flows = self.flows
        for param in self.module.parameters():
            param.grad = None  # the executor's optimizer steps with zero_grad(set_to_none=True)
        values: dict[str, object] = dict(inputs)
        leaves: dict[tuple[str, str], torch.Tensor] = {}
        fwd: dict[str, float] = {}
        with self.drawing():
            for layer in self.graph.layers:
                args = []
                for name in layer.inputs:
                    value = values[name]
                    leaf = value.detach().requires_grad_(flows.get(name, False) and value.is_floating_point())
                    leaves[(layer.name, name)] = leaf
                    args.append(leaf)
                fwd[layer.name], values[layer.name] = timed(
                    self.device, lambda r=self.runners[layer.name], a=args: run_at(r, a, batch))
        grads: dict[str, torch.Tensor] = {}
        bwd: dict[str, float] = {}
        for layer in reversed(self.graph.layers):
            value = values[layer.name] if layer.name in keep else values.pop(layer.name)
            bwd[layer.name] = self._backward(layer, value, grads, batch)
            del value
            for name in layer.inputs:
                grad = leaves.pop((layer.name, name)).grad
                if name in self.runners and grad is not None:
                    grads[name] = grads[name] + grad if name in grads else grad
        return fwd, bwd, {name: values[name] for name in keep}

    def whole(self, inputs: dict[str, torch.Tensor], *, batch: int) -> tuple[float, float]:
        """One pass as a one-stage executor runs it: the layers' forwards chained (no leaves between them,
        each value dropped after its last use), then one backward from ones at the output; (fwd_ms, bwd_ms)."""
        for param in self.module.parameters():
            param.grad = None
        graph, last_use = self.graph, self.last_use

        def forward() -> object:
            values: dict[str, object] = dict(inputs)
            for index, layer in enumerate(graph.layers):
                values[layer.name] = run_at(self.runners[layer.name], [values[name] for name in layer.inputs], batch)
                for name in layer.inputs:
                    if last_use[name] == index:
                        values.pop(name, None)
            return values[graph.output]

        with self.drawing():
            fwd_ms, output = timed(self.device, forward)
        outputs = floating_leaves(output)
        if not outputs:
            return fwd_ms, 0.0
        return fwd_ms, timed(self.device, lambda: torch.autograd.backward(outputs, [torch.ones_like(t)
                                                                                       for t in outputs]))[0]

    def _backward(self, layer: Layer, value: object, grads: dict[str, torch.Tensor], batch: int) -> float:
        """The layer's backward from the gradients its consumers sent (ones for the model's output); a
        backward that raises (an op needing more samples than ``batch``) is a :class:`LayerFailed`."""
        outputs = floating_leaves(value)
        if layer.name == self.graph.output and layer.name not in grads:
            gradients = [torch.ones_like(t) for t in outputs]
        elif layer.name in grads and isinstance(value, torch.Tensor) and value.requires_grad:
            outputs, gradients = [value], [grads.pop(layer.name)]
        else:
            return 0.0
        if not outputs:
            return 0.0
        try:
            return timed(self.device, lambda: torch.autograd.backward(outputs, gradients))[0]
        except DeeppoolError:
            raise
        except Exception as err:  # noqa: BLE001  any backward of the user's model: named, with its layer and batch
            raise LayerFailed(layer, None, batch, err) from None
