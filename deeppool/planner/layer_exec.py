"""Run one layer of a traced model on its own.

The profiler times layers with it and the executor trains with it, so both run
exactly the torch.fx nodes that the :class:`~deeppool.planner.graph.Layer`
names, with torch.fx's own node semantics (:class:`torch.fx.Interpreter`).
"""

from __future__ import annotations

import torch
from torch import fx

from deeppool.planner.graph import Layer


class LayerRunner:
    """Callable that computes a layer's output from its input tensors."""

    def __init__(self, module: fx.GraphModule, layer: Layer) -> None:
        by_name = {node.name: node for node in module.graph.nodes}
        missing = [name for name in (*layer.nodes, *layer.inputs) if name not in by_name]
        if missing:
            raise KeyError(f"layer '{layer.name}': node '{missing[0]}' is not in the traced model")
        self.layer = layer
        self._nodes = [by_name[name] for name in layer.nodes]
        self._inputs = [by_name[name] for name in layer.inputs]
        self._interpreter = fx.Interpreter(module)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        env: dict[fx.Node, object] = dict(zip(self._inputs, inputs, strict=True))
        self._interpreter.env = env
        for node in self._nodes:
            env[node] = self._interpreter.run_node(node)
        output = env[self._nodes[-1]]
        assert isinstance(output, torch.Tensor)
        return output


def runners(module: fx.GraphModule, layers: tuple[Layer, ...]) -> dict[str, LayerRunner]:
    """One runner per layer, by layer name."""
    return {layer.name: LayerRunner(module, layer) for layer in layers}
