"""A stage's layers compiled into one ``torch.fx.GraphModule``.

The nodes of the stage's layers are copied, in order, into a new fx graph whose
placeholders are the values the stage reads from outside (the model's inputs
and other stages' layer outputs) and whose output is the tuple of its layers'
values that other stages (or the loss) need. ``GraphModule`` generates
Python code for it, so a stage's forward is one call with no per-node
interpretation; the nodes keep the tracer's semantics (in-place ops, the
structured model output).

Per-sample randomness: the traced model's random nodes each start at an
ordinal in the whole model (:class:`~deeppool.planner.randomness.RandomSites`).
Before each such node the graph sets the mode's ordinal, exactly as the
per-layer runner does, so a stage draws what the model draws for the same
samples.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from deeppool.planner.graph import Layer
from deeppool.planner.layer_exec import structured_output
from deeppool.planner.randomness import RandomSites, SampleRandomness

_MODE = "deeppool_random_mode"


def set_ordinal(mode: SampleRandomness, ordinal: int) -> None:
    """Position the per-sample randomness mode at a node's first random call."""
    mode.ordinal = ordinal


class StageModule:
    """Callable: the stage's outside inputs (in :attr:`inputs` order) to its outputs by layer name."""

    def __init__(
        self,
        module: fx.GraphModule,
        layers: Sequence[Layer],
        outputs: Sequence[str],
        random: tuple[RandomSites, SampleRandomness] | None = None,
    ) -> None:
        self._module = module
        self.inputs = _outside_inputs(layers)
        self.outputs = tuple(outputs)
        self._structured = {name for name in outputs if _is_output(module, name)}
        self.graph_module = self._compile(module, layers, random)

    def __call__(self, *inputs: torch.Tensor) -> dict[str, Any]:
        values = self.graph_module(*inputs)
        return {
            name: structured_output(self._module, value) if name in self._structured else value
            for name, value in zip(self.outputs, values, strict=True)
        }

    def _compile(
        self, module: fx.GraphModule, layers: Sequence[Layer], random: tuple[RandomSites, SampleRandomness] | None
    ) -> fx.GraphModule:
        by_name = {node.name: node for node in module.graph.nodes}
        graph = fx.Graph()
        env: dict[str, Any] = {name: graph.placeholder(name) for name in self.inputs}
        attrs: dict[str, Any] = {}
        mode = graph.get_attr(_MODE) if random is not None else None
        for layer in layers:
            for node in (by_name[name] for name in layer.nodes):
                if random is not None and node.name in random[0].first:
                    graph.call_function(set_ordinal, (mode, random[0].first[node.name]))
                if node.op in ("call_module", "get_attr"):
                    attrs[str(node.target)] = operator.attrgetter(str(node.target))(module)
                if node.op == "output":
                    env[node.name] = fx.node.map_arg(node.args[0], lambda n: env[n.name])
                else:
                    env[node.name] = graph.node_copy(node, lambda n: env[n.name])
        graph.output(tuple(env[name] for name in self.outputs))
        if random is not None:
            attrs[_MODE] = random[1]
        return fx.GraphModule(attrs, graph, class_name="Stage")


def _outside_inputs(layers: Sequence[Layer]) -> tuple[str, ...]:
    """The values the layers read that none of them computes, in first-use order."""
    inside = {node for layer in layers for node in layer.nodes}
    return tuple(dict.fromkeys(src for layer in layers for src in layer.inputs if src not in inside))


def _is_output(module: fx.GraphModule, name: str) -> bool:
    return any(node.op == "output" and node.name == name for node in module.graph.nodes)
