"""A stage's layers compiled into one ``torch.fx.GraphModule``.

The nodes of the stage's layers are copied, in order, into a new fx graph whose
placeholders are the values the stage reads from outside (the model's inputs
and other stages' layer outputs) and whose output is the tuple of its layers'
values that other stages (or the loss) need. ``GraphModule`` generates
Python code for it, so a stage's forward is one call with no per-node
interpretation; the nodes keep the tracer's semantics (in-place ops, the
structured model output).

Per-sample randomness: the traced model's random nodes each start at an
ordinal in the whole model (:class:`~deeppool.model.randomness.RandomSites`).
Before each such node the graph sets the mode's ordinal, exactly as the
per-layer runner does, so a stage draws what the model draws for the same
samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import fx

from deeppool.model.graph import Layer
from deeppool.model.layer_exec import compile_layers, outside_inputs, structured_output
from deeppool.model.randomness import RandomSites, SampleRandomness


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
        self.inputs = outside_inputs(layers)
        self.outputs = tuple(outputs)
        self._structured = {name for name in outputs if _is_output(module, name)}
        self.graph_module = compile_layers(module, layers, self.outputs, random, name="Stage")

    def __call__(self, *inputs: torch.Tensor) -> dict[str, Any]:
        values = self.graph_module(*inputs)
        return {
            name: structured_output(self._module, value) if name in self._structured else value
            for name, value in zip(self.outputs, values, strict=True)
        }


def _is_output(module: fx.GraphModule, name: str) -> bool:
    return any(node.op == "output" and node.name == name for node in module.graph.nodes)
