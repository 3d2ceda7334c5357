"""Run one layer of a traced model on its own, or several compiled into one module.

Everything that runs layers runs exactly the torch.fx nodes that a
:class:`~deeppool.model.graph.Layer` names, with torch.fx's node semantics.
:class:`LayerRunner` interprets them node by node (:class:`torch.fx.Interpreter`;
for one-off runs: tracing's FLOP count, the batch probe). :func:`compile_layers`
copies them into one ``GraphModule``, whose generated Python code runs them with
no per-node interpretation: the executor's stages run that way, and so does the
profiler (:class:`CompiledLayerRunner`), so that a layer's measured time holds
no per-node interpretation cost, which the executor never pays
(``docs/notes/0001-profiler-times-what-the-executor-runs.md``).
A layer's value is its last node's: a tensor, or for the ``output`` layer the
model's output structure (rebuilt as ``forward`` returns it, e.g. a
``ModelOutput`` from an exported graph's flat outputs).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from deeppool.errors import DeeppoolError
from deeppool.model.graph import Layer
from deeppool.model.randomness import RandomSites, SampleRandomness


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


class CompiledLayerRunner(LayerRunner):
    """A :class:`LayerRunner` that runs its layer as generated code (:func:`compile_layers`), as the executor's
    stages do; when a call raises, the nodes are interpreted again to name the op at fault (:attr:`at`)."""

    @cached_property
    def _compiled(self) -> fx.GraphModule:
        return compile_layers(self._module, [self.layer], [self._nodes[-1].name], self._random)

    @cached_property
    def _order(self) -> tuple[str, ...]:
        return outside_inputs([self.layer])

    def __call__(self, *inputs: torch.Tensor) -> Any:
        by_name = dict(zip(self.layer.inputs, inputs, strict=True))
        try:
            # forward itself: GraphModule's call wrapper prints the generated code's traceback
            (value,) = self._compiled.forward(*(by_name[name] for name in self._order))
        except Exception:
            super().__call__(*inputs)  # raises again at its node, naming it in ``at``
            raise
        return structured_output(self._module, value) if self._nodes[-1].op == "output" else value


def runners(module: fx.GraphModule, layers: tuple[Layer, ...],
            random: tuple[RandomSites, SampleRandomness] | None = None) -> dict[str, LayerRunner]:
    """One compiled runner per layer, by layer name (each random node positioned in ``random``'s mode)."""
    return {layer.name: CompiledLayerRunner(module, layer, random) for layer in layers}


RANDOM_MODE = "deeppool_random_mode"
"""The attribute a compiled module holds the per-sample randomness mode under."""


def set_ordinal(mode: SampleRandomness, ordinal: int) -> None:
    """Position the per-sample randomness mode at a node's first random call."""
    mode.ordinal = ordinal


def outside_inputs(layers: Sequence[Layer]) -> tuple[str, ...]:
    """The values the layers read that none of them computes, in first-use order."""
    inside = {node for layer in layers for node in layer.nodes}
    return tuple(dict.fromkeys(src for layer in layers for src in layer.inputs if src not in inside))


def compile_layers(module: fx.GraphModule, layers: Sequence[Layer], outputs: Sequence[str],
                   random: tuple[RandomSites, SampleRandomness] | None = None, *, name: str = "Layers"
                   ) -> fx.GraphModule:
    """The layers' nodes copied, in order, into a new ``GraphModule``: its placeholders are
    :func:`outside_inputs`, its output the tuple of the ``outputs`` nodes' values (the ``output`` node's
    flat structure as it is). With ``random``, each random node is preceded by :func:`set_ordinal` to its
    ordinal in the whole model, as :class:`LayerRunner` positions it."""
    by_name = {node.name: node for node in module.graph.nodes}
    graph = fx.Graph()
    env: dict[str, Any] = {name: graph.placeholder(name) for name in outside_inputs(layers)}
    attrs: dict[str, Any] = {}
    mode = graph.get_attr(RANDOM_MODE) if random is not None else None
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
    graph.output(tuple(env[name] for name in outputs))
    if random is not None:
        attrs[RANDOM_MODE] = random[1]
    return fx.GraphModule(attrs, graph, class_name=name)


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
