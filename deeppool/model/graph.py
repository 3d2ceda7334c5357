"""LayerGraph: the traced model as a DAG of layers.

A *layer* is one tensor-producing operation of the traced model (an
``nn.Module`` call, a function such as ``torch.add`` or a tensor method),
together with the non-tensor "glue" nodes it reads (``x.size(0)``, a tuple
``getitem``...), which every rank that runs the layer recomputes locally.
Every layer output has the batch in dimension 0; shapes, activation bytes and
FLOPs are stored *per sample*, so the planner can scale them to any per-GPU
batch.

The graph is the contract between the tracer, the profiler, the planner and
the executor: ``nodes`` are the torch.fx node names that make up the layer in
execution order, so a process that re-traces the same model can run exactly
these nodes (see :mod:`deeppool.model.layer_exec`).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from typing import Any

import networkx as nx

from deeppool.errors import DeeppoolError
from deeppool.plans import Branch
from deeppool.plans.jsonio import check_version, field

GRAPH_SCHEMA_VERSION = 1
OUTPUT_LAYER = "output"
"""The name of the layer that builds a structured model output (a tuple, dict, ``ModelOutput``)."""


class TraceMethod(enum.Enum):
    """How the model was turned into a graph."""

    FX = "fx"
    EXPORT = "export"
    REAL = "real"
    """torch.export carrying real values, specialised on the branches on values it met (:mod:`deeppool.model.real_export`)."""


@dataclass(frozen=True, kw_only=True)
class Layer:
    """One layer of the traced model; sizes and FLOPs are per sample."""

    name: str
    op: str
    target: str
    nodes: tuple[str, ...]
    inputs: tuple[str, ...]
    output_shape: tuple[int, ...]
    dtype: str
    params: tuple[str, ...]
    param_bytes: int
    act_bytes: int
    fwd_flops: float
    bwd_flops: float
    channels_last: bool = False
    """The model computes this output channels-last (a 4-d or 5-d tensor with NHWC or NDHWC strides, as
    convolutions on channels-last inputs and permuted views give): a reshard keeps that layout, since some
    kernels run far slower on the other (``docs/notes/0012-reshards-keep-layout.md``)."""
    opaque: str = ""
    """Why this layer is one opaque submodule run eagerly (the tracer's error, one line); empty when traced
    (:mod:`deeppool.model.opaque`)."""

    def __post_init__(self) -> None:
        if not self.nodes or self.nodes[-1] != self.name:
            raise DeeppoolError(f"layer '{self.name}': its last node must be the layer itself")
        if min(self.param_bytes, self.act_bytes) < 0 or min(self.fwd_flops, self.bwd_flops) < 0:
            raise DeeppoolError(f"layer '{self.name}': sizes and FLOPs must be non-negative")

    @property
    def signature(self) -> str:
        """What determines this layer's cost: the op, its target and its shapes."""
        return f"{self.op}|{self.target}|{self.output_shape}|{self.param_bytes}|{self.dtype}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Layer:
        return cls(
            name=str(field(data, "name", kind="layer")),
            op=str(field(data, "op", kind="layer")),
            target=str(field(data, "target", kind="layer")),
            nodes=tuple(field(data, "nodes", kind="layer")),
            inputs=tuple(field(data, "inputs", kind="layer")),
            output_shape=tuple(int(d) for d in field(data, "output_shape", kind="layer")),
            dtype=str(field(data, "dtype", kind="layer")),
            params=tuple(field(data, "params", kind="layer")),
            param_bytes=int(field(data, "param_bytes", kind="layer")),
            act_bytes=int(field(data, "act_bytes", kind="layer")),
            fwd_flops=float(field(data, "fwd_flops", kind="layer")),
            bwd_flops=float(field(data, "bwd_flops", kind="layer")),
            channels_last=bool(data.get("channels_last", False)),
            opaque=str(data.get("opaque", "")),
        )


@dataclass(frozen=True, kw_only=True)
class LayerGraph:
    """The layers in a topological (execution) order, their model inputs and output.

    ``inputs`` are the names of the model's input placeholders, ``input_keys``
    the ``forward`` arguments they stand for (the keys of ``inputs()``), with
    their per-sample shapes; a layer input that names one of them reads the
    batch directly. ``output`` is the layer whose value the model returns: one
    layer's tensor, or the :data:`OUTPUT_LAYER` that builds a structure.
    """

    layers: tuple[Layer, ...]
    inputs: tuple[str, ...]
    input_shapes: tuple[tuple[int, ...], ...]
    output: str
    method: TraceMethod
    input_keys: tuple[str, ...] = ()
    branches: tuple[Branch, ...] = ()
    """Branches on tensor values the tracer specialised (LayerDrop 0), in the order they ran."""
    draws: tuple[Branch, ...] = ()
    """Where the model draws random numbers that no traced tensor feeds (``torch.rand([])`` for a
    specialised branch): not in the graph, so ``run --check``'s reference draws them apart from the
    per-sample streams (``taken`` is False)."""
    schema_version: int = GRAPH_SCHEMA_VERSION

    def __post_init__(self) -> None:
        if not self.input_keys:
            object.__setattr__(self, "input_keys", self.inputs)
        if len(self.input_keys) != len(self.inputs):
            raise DeeppoolError("the graph's input keys do not match its inputs")
        known = set(self.inputs)
        for layer in self.layers:
            missing = [name for name in layer.inputs if name not in known]
            if missing:
                raise DeeppoolError(
                    f"layer '{layer.name}' reads '{missing[0]}', which no earlier layer produces"
                )
            if layer.name in known:
                raise DeeppoolError(f"layer name '{layer.name}' appears twice")
            known.add(layer.name)
        if self.output not in known:
            raise DeeppoolError(f"graph output '{self.output}' is not a layer")

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(layer.name for layer in self.layers)

    def layer(self, name: str) -> Layer:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(name)

    def edges(self) -> list[tuple[str, str]]:
        """Layer-to-layer edges (producer, consumer); model inputs are not edges."""
        produced = set(self.names)
        return [
            (src, layer.name)
            for layer in self.layers
            for src in dict.fromkeys(layer.inputs)
            if src in produced
        ]

    def tied(self) -> list[tuple[str, ...]]:
        """Groups of layers that share a parameter (tied embeddings...): each must get one GPU count."""
        graph = nx.Graph()
        users: dict[str, str] = {}
        for layer in self.layers:
            for param in layer.params:
                first = users.setdefault(param, layer.name)
                if first != layer.name:
                    graph.add_edge(first, layer.name)
        order = {name: index for index, name in enumerate(self.names)}
        return [tuple(sorted(group, key=order.__getitem__)) for group in nx.connected_components(graph)]

    def dag(self) -> nx.DiGraph:
        """The graph as a networkx DAG whose nodes carry their :class:`Layer`."""
        graph = nx.DiGraph()
        for layer in self.layers:
            graph.add_node(layer.name, layer=layer)
        graph.add_edges_from(self.edges())
        return graph

    def to_json(self) -> dict[str, Any]:
        return {
            "artifact": "layer graph",
            "schema_version": self.schema_version,
            "method": self.method.value,
            "inputs": list(self.inputs),
            "input_keys": list(self.input_keys),
            "input_shapes": [list(shape) for shape in self.input_shapes],
            "output": self.output,
            "branches": [branch.to_json() for branch in self.branches],
            "draws": [draw.to_json() for draw in self.draws],
            "layers": [layer.to_json() for layer in self.layers],
        }

    @classmethod
    def from_json(cls, data: Any) -> LayerGraph:
        payload = check_version(data, kind="layer graph", schema_version=GRAPH_SCHEMA_VERSION)
        return cls(
            layers=tuple(Layer.from_json(item) for item in field(payload, "layers", kind="graph")),
            inputs=tuple(field(payload, "inputs", kind="graph")),
            input_keys=tuple(payload.get("input_keys", ())),
            input_shapes=tuple(
                tuple(int(d) for d in shape) for shape in field(payload, "input_shapes", kind="graph")
            ),
            output=str(field(payload, "output", kind="graph")),
            method=TraceMethod(field(payload, "method", kind="graph")),
            branches=tuple(Branch.from_json(item) for item in payload.get("branches", ())),
            draws=tuple(Branch.from_json(item) for item in payload.get("draws", ())),
        )


def grad_flows(graph: LayerGraph) -> dict[str, bool]:
    """Whether a gradient reaches each layer's output (float output fed by parameters)."""
    flows: dict[str, bool] = {}
    for layer in graph.layers:
        floating = layer.dtype.startswith(("float", "bfloat", "complex"))
        flows[layer.name] = floating and (
            bool(layer.params) or any(flows.get(src, False) for src in layer.inputs)
        )
    return flows
