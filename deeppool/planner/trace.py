"""Tracing: any ``nn.Module`` to a :class:`LayerGraph`.

torch.fx ``symbolic_trace`` first, with modules as layers; when fx cannot
trace the model, ``torch.export`` with a dynamic batch dimension, and the
exported aten nodes are grouped back into layers by their module path. The
batch dimension is found by running the graph at two batch sizes: nodes whose
dimension 0 follows the batch are layers, everything else (sizes, tuples,
parameters) is glue recomputed by the layer that reads it. Per-layer forward
and backward FLOPs come from :class:`torch.utils.flop_counter.FlopCounterMode`.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode

from deeppool.errors import DeeppoolError
from deeppool.planner.graph import Layer, LayerGraph, TraceMethod
from deeppool.planner.layer_exec import LayerRunner
from deeppool.planner.modelspec import LoadedModel

_PROBE_BATCHES = (2, 3)
_LAYER_OPS = ("call_module", "call_function", "call_method")


@dataclass(frozen=True)
class Traced:
    """A traced model: the executable fx module and its layer graph."""

    module: fx.GraphModule
    graph: LayerGraph


class _PathTracer(fx.Tracer):
    """An fx tracer that remembers the module it was inside when tracing failed."""

    def __init__(self) -> None:
        super().__init__()
        self.failed_in: str | None = None

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = self.path_of_module(m) or "<root>"
            raise


def trace(loaded: LoadedModel, method: TraceMethod | None = None) -> Traced:
    """Trace ``loaded`` with ``method``, or fx then export when ``method`` is None."""
    if method is TraceMethod.EXPORT:
        return _graph_of(_export(loaded), loaded, TraceMethod.EXPORT)
    try:
        module = _fx_trace(loaded.module)
    except DeeppoolError as fx_error:
        if method is TraceMethod.FX:
            raise
        try:
            module = _export(loaded)
        except DeeppoolError as export_error:
            raise DeeppoolError(f"{fx_error}; {export_error}") from None
        return _graph_of(module, loaded, TraceMethod.EXPORT)
    return _graph_of(module, loaded, TraceMethod.FX)


def _fx_trace(model: nn.Module) -> fx.GraphModule:
    tracer = _PathTracer()
    try:
        graph = tracer.trace(model)
    except Exception as err:
        where = tracer.failed_in or "<root>"
        raise DeeppoolError(
            f"torch.fx cannot trace module '{where}' ({type(err).__name__}: {_first_line(err)})"
        ) from None
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _export(loaded: LoadedModel) -> fx.GraphModule:
    device = _device_of(loaded.module)
    example = tuple(t.to(device) for t in loaded.inputs(_PROBE_BATCHES[0]))
    batch = torch.export.Dim("batch", min=1)
    dynamic = tuple({0: batch} for _ in example)
    try:
        with _quiet_torch_logs():
            program = torch.export.export(loaded.module, example, dynamic_shapes=dynamic, strict=False)
    except Exception as err:
        raise DeeppoolError(
            f"torch.export cannot trace the model either ({type(err).__name__}: {_first_line(err)})"
        ) from None
    return program.module()


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    """torch.export logs and prints whole graphs on failure; the error message is enough."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield
    finally:
        logger.setLevel(level)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "no message"


class _Recorder(fx.Interpreter):
    """Runs the graph and keeps every node's value and forward FLOPs."""

    def __init__(self, module: fx.GraphModule, counter: FlopCounterMode) -> None:
        super().__init__(module)
        self.counter = counter
        self.values: dict[str, Any] = {}
        self.flops: dict[str, int] = {}

    def run_node(self, n: fx.Node) -> Any:
        before = self.counter.get_total_flops()
        value = super().run_node(n)
        self.values[n.name] = value
        self.flops[n.name] = self.counter.get_total_flops() - before
        return value


class _ShapeOnly:
    """Runs ops for their shapes only: on ``meta`` tensors when the model was built
    on the meta device (fast), else under a :class:`FakeTensorMode`."""

    def __init__(self, device: torch.device) -> None:
        self.meta = device.type == "meta"
        self.fake = None if self.meta else FakeTensorMode(allow_non_fake_inputs=True)

    def __enter__(self) -> None:
        if self.fake is not None:
            self.fake.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.fake is not None:
            self.fake.__exit__(*exc)

    def tensor(self, value: torch.Tensor) -> torch.Tensor:
        if self.meta:
            return value.to("meta")
        assert self.fake is not None
        return self.fake.from_tensor(value)


def _record(module: fx.GraphModule, inputs: tuple[torch.Tensor, ...], shapes: _ShapeOnly) -> _Recorder:
    with FlopCounterMode(display=False) as counter:
        recorder = _Recorder(module, counter)
        _run(recorder, inputs, shapes)
    return recorder


def _run(recorder: _Recorder, inputs: tuple[torch.Tensor, ...], shapes: _ShapeOnly) -> None:
    with shapes, torch.no_grad():
        try:
            recorder.run(*(shapes.tensor(t) for t in inputs))
        except Exception as err:
            raise DeeppoolError(
                f"the traced model fails on its own inputs ({type(err).__name__}: {_first_line(err)}): "
                "check inputs(batch_size) against model()"
            ) from None


def _device_of(module: nn.Module) -> torch.device:
    """Where the model's parameters live (``meta`` when it was built for planning only)."""
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def _batched(module: fx.GraphModule, loaded: LoadedModel, shapes: _ShapeOnly) -> tuple[set[str], _Recorder]:
    """Names of nodes whose value is a tensor with the batch in dimension 0."""
    probe, other = (_record(module, loaded.inputs(b), shapes) for b in _PROBE_BATCHES)
    small, large = probe.values, other.values
    batched = {
        name
        for name, value in small.items()
        if isinstance(value, torch.Tensor)
        and value.dim() > 0
        and isinstance(large.get(name), torch.Tensor)
        and (value.shape[0], large[name].shape[0]) == _PROBE_BATCHES
    }
    return batched, probe


def _graph_of(module: fx.GraphModule, loaded: LoadedModel, method: TraceMethod) -> Traced:
    """Probe the graph; buffers (batch-norm running statistics) and gradients are restored after."""
    saved = {name: buffer.clone() for name, buffer in module.named_buffers()}
    grads = {name: param.grad for name, param in module.named_parameters()}
    try:
        return _probed_graph(module, loaded, method)
    finally:
        with torch.no_grad():
            for name, buffer in module.named_buffers():
                buffer.copy_(saved[name])
        for name, param in module.named_parameters():
            param.grad = grads[name]


def _probed_graph(module: fx.GraphModule, loaded: LoadedModel, method: TraceMethod) -> Traced:
    """Shapes and FLOPs come from meta or fake tensors: no arithmetic is done."""
    shapes = _ShapeOnly(_device_of(module))
    batched, probe = _batched(module, loaded, shapes)
    values = probe.values
    nodes = list(module.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    heads = [n for n in nodes if n.op in _LAYER_OPS and n.name in batched]
    groups = _group(heads, method)
    with FlopCounterMode(display=False) as counter:
        builder = _LayerBuilder(module, probe, {n.name for n in placeholders}, groups, shapes, counter)
        layers = tuple(builder.build(group) for group in groups)
    output = _output_layer(nodes, builder.layer_of)
    graph = LayerGraph(
        layers=layers,
        inputs=tuple(n.name for n in placeholders),
        input_shapes=tuple(tuple(values[n.name].shape[1:]) for n in placeholders),
        output=output,
        method=method,
    )
    return Traced(module=module, graph=graph)


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, _ = list(stack.values())[-1]
    return str(path)


def _module_type(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    _, kind = list(stack.values())[-1]
    return getattr(kind, "__name__", str(kind).rsplit(".", 1)[-1].strip("'>"))


def _group(heads: list[fx.Node], method: TraceMethod) -> list[list[fx.Node]]:
    """fx: one node per layer; export: consecutive nodes of one module, one output."""
    if method is TraceMethod.FX:
        return [[node] for node in heads]
    runs: list[list[fx.Node]] = []
    for node in heads:
        if runs and _module_path(node) and _module_path(runs[-1][-1]) == _module_path(node):
            runs[-1].append(node)
        else:
            runs.append([node])
    groups: list[list[fx.Node]] = []
    for run in runs:
        members = set(run)
        escaping = [n for n in run if any(user not in members for user in n.users)]
        groups.extend([run] if escaping == [run[-1]] else [[n] for n in run])
    return groups


class _LayerBuilder:
    """Turns a group of head nodes plus their glue into a :class:`Layer`."""

    def __init__(
        self,
        module: fx.GraphModule,
        probe: _Recorder,
        placeholders: set[str],
        groups: list[list[fx.Node]],
        shapes: _ShapeOnly,
        counter: FlopCounterMode,
    ) -> None:
        self.module = module
        self.shapes = shapes
        self.counter = counter
        self.values = probe.values
        self.forward_flops = probe.flops
        self.placeholders = placeholders
        self.layer_of = {node.name: group[-1].name for group in groups for node in group}
        self.order = {node.name: index for index, node in enumerate(module.graph.nodes)}
        self.by_name = {node.name: node for node in module.graph.nodes}

    def build(self, group: list[fx.Node]) -> Layer:
        members: set[str] = {node.name for node in group}
        inputs: list[str] = []
        for node in group:
            self._collect(node, members, inputs, set(members))
        head = group[-1]
        names = tuple(sorted(members, key=self.order.__getitem__))
        params = self._params(names)
        value = self.values[head.name]
        sample_numel = value[0].numel()
        fwd, bwd = self._flops(names, tuple(inputs), head)
        return Layer(
            name=head.name,
            op=self._op(head, params),
            target=self._target(head),
            nodes=names,
            inputs=tuple(inputs),
            output_shape=tuple(value.shape[1:]),
            dtype=str(value.dtype).removeprefix("torch."),
            params=params,
            param_bytes=self._param_bytes(params),
            act_bytes=sample_numel * value.element_size(),
            fwd_flops=fwd / _PROBE_BATCHES[0],
            bwd_flops=bwd / _PROBE_BATCHES[0],
        )

    def _collect(self, node: fx.Node, members: set[str], inputs: list[str], seen: set[str]) -> None:
        for arg in node.all_input_nodes:
            if arg.name in seen:
                continue
            seen.add(arg.name)
            if arg.name in self.placeholders or arg.name in self.layer_of:
                source = self.layer_of.get(arg.name, arg.name)
                if source != arg.name:
                    raise DeeppoolError(
                        f"node '{node.name}' reads '{arg.name}' from inside layer '{source}': "
                        "this model cannot be split into layers"
                    )
                if source not in inputs:
                    inputs.append(source)
            else:
                members.add(arg.name)
                self._collect(arg, members, inputs, seen)

    def _params(self, names: tuple[str, ...]) -> tuple[str, ...]:
        found: dict[str, None] = {}
        for name in names:
            node = self.by_name[name]
            if node.op == "call_module":
                submodule = self.module.get_submodule(str(node.target))
                for pname, _ in submodule.named_parameters():
                    found[f"{node.target}.{pname}"] = None
            elif node.op == "get_attr" and isinstance(
                _attr(self.module, str(node.target)), nn.Parameter
            ):
                found[str(node.target)] = None
        return tuple(found)

    def _param_bytes(self, params: tuple[str, ...]) -> int:
        total = 0
        for name in params:
            tensor = _attr(self.module, name)
            total += tensor.numel() * tensor.element_size()
        return total

    def _op(self, head: fx.Node, params: tuple[str, ...]) -> str:
        """The module class for module calls and parameterised groups, else the function."""
        if head.op == "call_module":
            return type(self.module.get_submodule(str(head.target))).__name__
        if params and _module_type(head):
            return _module_type(head)
        name = getattr(head.target, "__name__", str(head.target))
        return name.removesuffix(".default")

    def _target(self, head: fx.Node) -> str:
        if head.op == "call_module":
            return str(head.target)
        return _module_path(head) or getattr(head.target, "__name__", str(head.target))

    def _flops(self, names: tuple[str, ...], inputs: tuple[str, ...], head: fx.Node) -> tuple[float, float]:
        """Forward FLOPs from the probe run; backward by running the layer's backward.

        The FLOP counter counts matrix products and convolutions only, so a
        layer without forward FLOPs has no backward FLOPs either and is skipped.
        """
        forward = sum(self.forward_flops.get(name, 0) for name in names)
        if forward == 0:
            return 0.0, 0.0
        layer = Layer(
            name=head.name, op="", target="", nodes=names, inputs=inputs, output_shape=(),
            dtype="", params=(), param_bytes=0, act_bytes=0, fwd_flops=0.0, bwd_flops=0.0,
        )
        runner = LayerRunner(self.module, layer)
        with self.shapes:
            args = [_grad_input(self.values[name]) for name in inputs]
            output = runner(*args)
            before = self.counter.get_total_flops()
            if output.requires_grad:
                output.backward(torch.ones_like(output))
            backward = self.counter.get_total_flops() - before
        return float(forward), float(backward)


def _grad_input(value: torch.Tensor) -> torch.Tensor:
    copy = value.detach().clone()
    return copy.requires_grad_(copy.is_floating_point())


def _attr(module: nn.Module, dotted: str) -> torch.Tensor:
    value: Any = module
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _output_layer(nodes: list[fx.Node], layer_of: dict[str, str]) -> str:
    output = next(n for n in nodes if n.op == "output")
    result = output.args[0]
    while isinstance(result, (tuple, list)) and len(result) == 1:
        result = result[0]
    if not isinstance(result, fx.Node) or result.name not in layer_of:
        raise DeeppoolError("the model must return a single batched tensor computed by a layer")
    return layer_of[result.name]
