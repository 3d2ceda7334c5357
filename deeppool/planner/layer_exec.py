"""Run one layer of a traced model on its own.

The profiler times layers with it and the executor trains with it, so both run
exactly the torch.fx nodes that the :class:`~deeppool.planner.graph.Layer`
names, with torch.fx's own node semantics (:class:`torch.fx.Interpreter`).
A layer's value is its last node's: a tensor, or for the ``output`` layer the
model's output structure (rebuilt as ``forward`` returns it, e.g. a
``ModelOutput`` from an exported graph's flat outputs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from deeppool.errors import DeeppoolError
from deeppool.planner.graph import Layer
from deeppool.planner.randomness import RandomSites, SampleRandomness


def structured_output(module: fx.GraphModule, flat: Any) -> Any:
    """The value of ``module``'s output node as its ``forward`` returns it."""
    return module.graph.process_outputs(flat)


def floating_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors in ``value`` (a tensor or a structure) that gradients flow back from."""
    return [
        leaf for leaf in pytree.tree_leaves(value)
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad
    ]


class LayerRunner:
    """Callable that computes a layer's output from its input tensors.

    With ``random`` (the model's random sites and an active per-sample mode),
    each node that draws random numbers starts at its ordinal in the whole
    model, so the layer draws what the model would for the same samples.
    """

    def __init__(
        self, module: fx.GraphModule, layer: Layer, random: tuple[RandomSites, SampleRandomness] | None = None
    ) -> None:
        by_name = {node.name: node for node in module.graph.nodes}
        missing = [name for name in (*layer.nodes, *layer.inputs) if name not in by_name]
        if missing:
            raise KeyError(f"layer '{layer.name}': node '{missing[0]}' is not in the traced model")
        self.layer = layer
        self._module = module
        self._nodes = [by_name[name] for name in layer.nodes]
        self._inputs = [by_name[name] for name in layer.inputs]
        self._interpreter = fx.Interpreter(module)
        self._random = random
        self.at: fx.Node | None = None
        """The node running now (the one at fault when a call raises)."""

    def __call__(self, *inputs: torch.Tensor) -> Any:
        env: dict[fx.Node, object] = dict(zip(self._inputs, inputs, strict=True))
        self._interpreter.env = env
        for node in self._nodes:
            self.at = node
            if self._random is not None and node.name in self._random[0].first:
                self._random[1].ordinal = self._random[0].first[node.name]
            env[node] = self._interpreter.run_node(node)
        last = self._nodes[-1]
        return structured_output(self._module, env[last]) if last.op == "output" else env[last]


def runners(module: fx.GraphModule, layers: tuple[Layer, ...]) -> dict[str, LayerRunner]:
    """One runner per layer, by layer name."""
    return {layer.name: LayerRunner(module, layer) for layer in layers}


class LayerFailed(DeeppoolError):
    """A layer that raised when it ran at a per-GPU batch (an op that needs more samples than it got)."""

    def __init__(self, layer: Layer, node: fx.Node | None, batch: int, err: BaseException) -> None:
        self.layer, self.batch = layer, batch
        op = getattr(node.target, "__name__", str(node.target)) if node is not None else layer.op
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        super().__init__(
            f"layer '{layer.name}' ({layer.op} in module '{layer.target}') fails at per-GPU batch {batch}: "
            f"op {op} raised {type(err).__name__}: {first}"
        )


def run_at(runner: LayerRunner, args: list[Any], batch: int) -> Any:
    """``runner(*args)`` at per-GPU ``batch``; an op that raises there is a :class:`LayerFailed` naming the layer
    and the op, not a traceback."""
    try:
        return runner(*args)
    except DeeppoolError:
        raise
    except Exception as err:  # noqa: BLE001  any op of the user's model: named, with its layer and batch
        raise LayerFailed(runner.layer, runner.at, batch, err) from None
