"""Tracing: any ``nn.Module`` to a :class:`LayerGraph`.

torch.fx ``symbolic_trace`` first, with modules as layers (arguments that
``inputs()`` does not give, or gives as non-tensors, are traced as the
constants they are); when fx cannot trace the model, ``torch.export`` with a
dynamic batch dimension (in training mode), and the exported aten nodes are
grouped back into layers by their module path. When both stop inside a
submodule (eager-only code), fx again with that submodule as one opaque layer
(:mod:`deeppool.model.opaque`); when export stops at a branch on a value in the
root's own code, the real-tensor tracer specialised on the values seen
(:mod:`deeppool.model.real_export`). The batch dimension is found by
running the graph at two batch sizes: nodes whose dimension 0 follows the batch
are layers, everything else (sizes, tuples, parameters) is glue recomputed by
the layer that reads it. In-place operations are made safe to split first
(:mod:`deeppool.model.mutation`). A model whose output is not one layer's
tensor (a tuple, dict, ``ModelOutput``, a loss it computes itself) gets an
``output`` layer that computes the whole output structure from the layers it
reads. A parameter used by several layers (tied embeddings) is named once, by
its first name in ``named_parameters()``, and its bytes count in the first
layer that uses it. Per-layer forward and backward FLOPs come from
:class:`torch.utils.flop_counter.FlopCounterMode`.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import linecache
import logging
import re
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils.flop_counter import FlopCounterMode

from deeppool.errors import DeeppoolError
from deeppool.model.functions import functions_as_nodes, functions_called, refuse_traced_through
from deeppool.model.graph import OUTPUT_LAYER, Layer, LayerGraph, TraceMethod
from deeppool.model.layer_exec import LayerRunner, floating_leaves, structured_output
from deeppool.model.loading import LoadedModel, load_model
from deeppool.model.mutation import Mutation, Probe, after_mutation, functionalize, merged_groups
from deeppool.model.opaque import ModuleFailure, check_rows, data_dependent, enclosing_module
from deeppool.model.randomness import RandomSites, SampleRandomness, batched_calls
from deeppool.model.real_export import InsideModule, real_export
from deeppool.plans import Branch, ModelSpec

_PROBE_BATCHES = (2, 3)
_SKIPPED = (str(Path(torch.__file__).parent), str(Path(__file__).resolve().parents[1]), "<")
"""Frames that are not the model's code: torch's, deeppool's, generated code's."""
_LAYER_OPS = ("call_module", "call_function", "call_method")
_LAYERDROP = re.compile(r"torch\.rand\b|random\.(uniform|random)\b|layerdrop|dropout_probability", re.IGNORECASE)
"""A source line that compares a random draw with a probability: LayerDrop."""
_FX_IDIOMS = (
    ("slice indices", "a slice with a tensor bound"),
    ("used as inputs to control flow", "a value-dependent branch"),
    ("cannot be iterated", "a loop over a tensor's values"),
    ("does not support item assignment", "an assignment into a slice of a traced tensor"),
)
"""Words of torch.fx's error and what they mean in the model's code."""
_BATCH_FIXED = "specialized it to be a constant"
"""torch.export's words for a dynamic batch dimension the model's code fixed."""
_INDEX_OPS = ("nonzero", "argwhere")
"""Ops whose output rows are positions in their input."""


@dataclass(frozen=True)
class Traced:
    """A traced model: the executable fx module, its layer graph and where it draws random numbers."""

    module: fx.GraphModule
    graph: LayerGraph
    random: RandomSites


class RandomBranchError(DeeppoolError):
    """A branch on a random value goes both ways: no tracer can make one graph of the model."""


class ValueBranchError(DeeppoolError):
    """torch.export stopped at a branch on a tensor's value (the real-tensor tracer may take it)."""


class _PathTracer(fx.Tracer):
    """An fx tracer that remembers the module it was inside when tracing failed, and keeps the ``opaque``
    submodules (by path) as leaves: one ``call_module`` node each, run eagerly."""

    def __init__(self, opaque: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.opaque = opaque
        self.failed_in: str | None = None

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.opaque or super().is_leaf_module(m, module_qualified_name)

    def call_module(self, m: nn.Module, forward: Any, args: Any, kwargs: Any) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = self.path_of_module(m) or "<root>"
            raise


def trace_spec(spec: ModelSpec, *, meta: bool) -> tuple[LoadedModel, Traced]:
    """Build and trace the model ``spec`` names: on the meta device when ``meta`` and torch.fx traces it there.

    Planning with a device model needs shapes only, so it tries the meta device (no storage, no
    initialisation) first; but only torch.fx's graph is the same on every device. A model that
    fx cannot trace, or that fails on meta tensors (a constructor that reads values, autocast on
    ``meta``), is built and traced on CPU tensors at a small batch, as ``run`` traces it: export
    decomposes some operations differently on meta (``x[..., 0] = 0`` is ``copy_`` there,
    ``fill_`` on CPU), so the plan's graph is the one ``run`` traces by construction.
    """
    if meta:
        try:
            loaded = load_model(spec, meta=True)
            return loaded, trace(loaded, TraceMethod.FX)
        except Exception:  # noqa: BLE001  any failure on meta is retried on CPU, which reports its own
            pass
    loaded = load_model(spec)
    return loaded, trace(loaded)


def trace(loaded: LoadedModel, method: TraceMethod | None = None) -> Traced:
    """Trace ``loaded`` with ``method``, or when ``method`` is None: fx, then export, then fx again with each
    submodule that stopped them as an opaque layer (:mod:`deeppool.model.opaque`)."""
    named = loaded.named_inputs(_PROBE_BATCHES[0])
    if method is TraceMethod.EXPORT:
        return _graph_of(_export(loaded.module, named), loaded, TraceMethod.EXPORT)
    try:
        return _fx_graph(loaded, named, {})
    except ModuleFailure as fx_error:
        if method is TraceMethod.FX:
            raise
        failure = fx_error
    if not failure.retry_export:  # fx traced it; a data-dependent shape inside a module stopped its probe
        return _opaque_graph(loaded, named, failure)
    try:
        module = _export(loaded.module, named)
    except DeeppoolError as export_error:
        joined = ModuleFailure(f"{failure}; {export_error}", module=failure.module, reason=failure.reason)
        return _opaque_graph(loaded, named, joined, real_too=isinstance(export_error, ValueBranchError))
    try:
        return _graph_of(module, loaded, TraceMethod.EXPORT)
    except ModuleFailure:
        return _opaque_graph(loaded, named, failure)


def _real_graph(loaded: LoadedModel, named: Mapping[str, Any]) -> Traced | None:
    """The real-tensor tracer's graph, specialised on the branches on values outside any submodule; None
    when one is inside a submodule or it cannot trace the model either (an opaque layer may)."""
    kwargs, dynamic = _export_inputs(loaded.module, named)
    try:
        with _quiet_torch_logs(), functions_called(_where_now) as calls:
            exported = real_export(loaded.module, kwargs, dynamic)
    except InsideModule:
        return None
    except DeeppoolError:
        raise
    except Exception:  # noqa: BLE001  the tracer's own failure: the opaque-layer fallback reports its own
        return None
    refuse_traced_through(calls)
    return _graph_of(exported.module, loaded, TraceMethod.REAL, (exported.branches, ()))


def _fx_graph(loaded: LoadedModel, named: Mapping[str, Any], opaque: Mapping[str, ModuleFailure]) -> Traced:
    """fx's graph of ``loaded`` with the ``opaque`` submodules (path: the failure that made it opaque) as
    leaves, probed."""
    module, seen = _fx_trace(loaded.module, named, frozenset(opaque))
    return _graph_of(module, loaded, TraceMethod.FX, (tuple(seen.branches), tuple(seen.draws)), opaque)


def _opaque_graph(loaded: LoadedModel, named: Mapping[str, Any], failure: ModuleFailure, *,
                  real_too: bool = True) -> Traced:
    """fx's graph with every submodule a tracer stops inside as one opaque layer; when one stops in the
    root's own code, the real-tensor tracer's graph (with ``real_too``), else ``failure``."""
    opaque: dict[str, ModuleFailure] = {}
    while failure.module is not None and failure.module not in opaque:
        opaque[failure.module] = failure
        try:
            return _fx_graph(loaded, named, opaque)
        except ModuleFailure as again:
            failure = again
    real = _real_graph(loaded, named) if real_too and failure.module is None else None
    if real is None:
        raise failure
    return real


def _fx_trace(model: nn.Module, named: Mapping[str, Any],
              opaque: frozenset[str] = frozenset()) -> tuple[fx.GraphModule, BranchWatch]:
    """fx's graph and the branches on tensor values it specialised.

    fx runs eagerly whatever no traced tensor feeds: ``torch.rand([])`` draws a real number and
    ``if torch.rand([]) < self.layerdrop`` takes one way. Such a model is traced twice, every
    draw forced to the smallest and then the largest value it can take: a branch that goes
    both ways depends on the draw (LayerDrop above 0) and is refused naming its line; one that
    goes one way (LayerDrop 0) is specialised and listed; a drawn value that reaches the graph
    as a constant is refused.
    """
    low, low_seen = _fx_trace_once(model, named, 0.0, opaque)
    if not low_seen.draws:
        return low, low_seen
    high, high_seen = _fx_trace_once(model, named, 1.0 - 2.0**-24, opaque)
    for first, second in zip(low_seen.branches, high_seen.branches, strict=False):
        if first != second:
            raise RandomBranchError(
                f"a branch on a random value at {first.file}:{first.line}{_source(first.file, first.line)} goes both "
                "ways (LayerDrop above 0?): the layers would change from step to step; set its probability to 0 "
                "or wrap the branch in a module that always takes one way"
            )
    if low.code != high.code or len(low_seen.branches) != len(high_seen.branches) or not _same_constants(low, high):
        message = ("a value drawn while tracing (torch.rand, no traced tensor feeding it) reaches the graph as a "
                   "constant: draw it from a traced tensor (torch.rand_like(x)) so that it is drawn every step")
        raise ModuleFailure(message, module=None, reason=message)
    return low, low_seen


def _same_constants(first: fx.GraphModule, second: fx.GraphModule) -> bool:
    """Whether the tensors fx stored as constants (not parameters or buffers) are equal."""
    def constants(module: fx.GraphModule) -> dict[str, torch.Tensor]:
        return {n.target: _attr(module, str(n.target)) for n in module.graph.nodes
                if n.op == "get_attr" and str(n.target).startswith("_tensor_constant")}
    ours, theirs = constants(first), constants(second)
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


class BranchWatch(TorchDispatchMode):
    """Watches what runs eagerly: random draws (forced to ``extreme`` when given) and branches on tensor values.

    fx's tracer runs under it to find the branches it specialises; ``run --check`` runs its
    single-process reference under it to verify they still go the planned way.
    """

    def __init__(self, extreme: float | None = None, apart: tuple[Branch, ...] = ()) -> None:
        super().__init__()
        self.extreme = extreme
        self.apart = {(draw.file, draw.line) for draw in apart}
        self.draws: list[Branch] = []
        self.branches: list[Branch] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        seeded = torch.Tag.nondeterministic_seeded in func.tags
        where = _user_stack_frame() if seeded else None
        if where in self.apart:  # a draw the graph does not have: outside the per-sample streams, RNG kept
            with _disable_current_modes(), torch.random.fork_rng(devices=[]):
                return func(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if seeded:
            if where is not None:
                self.draws.append(Branch(file=where[0], line=where[1], taken=False))
            for leaf in pytree.tree_leaves(out) if self.extreme is not None else ():
                if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                    leaf.fill_(self.extreme)
        elif func in (torch.ops.aten.is_nonzero.default, torch.ops.aten._local_scalar_dense.default):
            where = _user_stack_frame()
            if where is not None and isinstance(out, bool | int | float):
                self.branches.append(Branch(file=where[0], line=where[1], taken=bool(out)))
        return out


def check_branches(planned: tuple[Branch, ...], seen: list[Branch]) -> None:
    """Raise, in one line, at the first planned branch that ``seen`` took the other way.

    Line by line: fx lists every time a line branched, in order; the real-tensor tracer lists a line
    once, the way every pass through it must go. A planned branch at a line ``seen`` never reports is one
    on a size (``nonzero(...).size(0) > 0``, which eager torch answers with a Python int, not a tensor):
    the comparison of results checks it.
    """
    ways: dict[tuple[str, int], list[bool]] = {}
    for branch in planned:
        ways.setdefault((branch.file, branch.line), []).append(branch.taken)
    went: dict[tuple[str, int], list[bool]] = {}
    for branch in seen:
        if (branch.file, branch.line) in ways:
            went.setdefault((branch.file, branch.line), []).append(branch.taken)
    for (file, line), taken in went.items():
        want = ways[(file, line)]
        if taken != want and not (len(want) == 1 and set(taken) == set(want)):
            raise DeeppoolError(
                f"the branch at {file}:{line}{_source(file, line)} went {len(taken)} times, "
                f"{sum(taken)} taken, where the plan has {len(want)}, {sum(want)} taken: the plan's layers are no "
                "longer the model's (a branch on a random draw or on the data); re-plan it"
            )


def _user_stack_frame() -> tuple[str, int] | None:
    """The innermost frame of the current stack in the model's code."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename and not frame.filename.startswith(_SKIPPED) and "/contextlib.py" not in frame.filename:
            return frame.filename, frame.lineno or 0
    return None


def _fx_trace_once(model: nn.Module, named: Mapping[str, Any], extreme: float,
                   opaque: frozenset[str]) -> tuple[fx.GraphModule, BranchWatch]:
    tracer = _PathTracer(opaque)
    buffers = dict(model.named_buffers())
    saved = {name: (buffer._version, buffer.clone()) for name, buffer in buffers.items()}
    rng = torch.random.get_rng_state()
    watch = BranchWatch(extreme)
    try:
        with watch, functions_as_nodes(tracer, _where_now):
            graph = tracer.trace(model, concrete_args=_concrete_args(model, named) or None)
    except Exception as err:
        where = tracer.failed_in or type(model).__name__
        reason = f"{type(err).__name__}: {_first_line(err)}"
        raise ModuleFailure(
            f"torch.fx cannot trace module '{where}': {_what_fx_met(err)}{_at_line(err).lstrip()} ({reason})",
            module=tracer.failed_in if tracer.failed_in != "<root>" else None, reason=f"{reason}{_at_line(err)}",
        ) from None
    finally:
        torch.random.set_rng_state(rng)
        changed = [name for name, buffer in buffers.items() if buffer._version != saved[name][0]]
        with torch.no_grad():
            for name in changed:
                buffers[name].copy_(saved[name][1])
    if changed:  # fx ran the update eagerly on the real buffer: it is not in the graph
        message = f"torch.fx cannot trace the update of buffer '{changed[0]}' in forward"
        raise ModuleFailure(message, module=None, reason=message)
    return fx.GraphModule(tracer.root, graph, type(model).__name__), watch


def _where_now() -> str:
    """`` at FILE:LINE (`source`)`` of the model's code running now ('' when none is on the stack)."""
    frame = _user_stack_frame()
    return f" at {frame[0]}:{frame[1]}{_source(*frame)}" if frame is not None else ""


def _source(filename: str, lineno: int) -> str:
    text = linecache.getline(filename, lineno).strip()
    return f" (`{text}`)" if text else ""


def _at_line(err: BaseException) -> str:
    """`` at FILE:LINE (`source`)`` of the model's code where ``err`` was raised ('' when no such frame)."""
    frame = user_frame(err)
    if frame is None:
        return ""
    return f" at {frame[0]}:{frame[1]}{_source(*frame)}"


def user_frame(err: BaseException) -> tuple[str, int] | None:
    """The innermost frame of ``err``'s traceback in the model's code (not torch's, not deeppool's)."""
    found = None
    for frame, lineno in traceback.walk_tb(err.__traceback__):
        filename = frame.f_code.co_filename
        if not filename.startswith(_SKIPPED) and "/contextlib.py" not in filename:
            found = (filename, lineno)
    return found


def _concrete_args(model: nn.Module, named: Mapping[str, Any]) -> dict[str, Any]:
    """``forward``'s arguments that are constants: given as non-tensors, or not given (their defaults)."""
    concrete = {}
    for name, parameter in inspect.signature(model.forward).parameters.items():
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if name in named and not isinstance(named[name], torch.Tensor):
            concrete[name] = named[name]
        elif name not in named and parameter.default is not inspect.Parameter.empty:
            concrete[name] = parameter.default
    return concrete


def _export_inputs(model: nn.Module, named: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """torch.export's keyword inputs (on the model's device) and their dynamic batch dimension; the model
    is put in training mode (the exported graph keeps it: dropout on, BatchNorm on batch statistics)."""
    device = _device_of(model)
    kwargs = {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in named.items()}
    batch = torch.export.Dim("batch", min=1)
    dynamic = {name: {0: batch} if isinstance(value, torch.Tensor) else None for name, value in kwargs.items()}
    model.train()
    return kwargs, dynamic


def _export(model: nn.Module, named: Mapping[str, Any]) -> fx.GraphModule:
    kwargs, dynamic = _export_inputs(model, named)
    try:
        with _quiet_torch_logs(), functions_called(_where_now) as calls:
            program = torch.export.export(model, (), kwargs=kwargs, dynamic_shapes=dynamic, strict=False)
    except Exception as err:
        message = _export_failure(err)
        raise (ValueBranchError if data_dependent(err) else DeeppoolError)(message) from None
    refuse_traced_through(calls)
    return program.module()


def _export_failure(err: BaseException) -> str:
    """One line: where in the model's code torch.export stopped, and why."""
    reason = f"{type(err).__name__}: {_first_line(err)}"
    if _BATCH_FIXED in str(err):
        return (f"torch.export cannot trace the model either{_at_line(err)}: its code makes the batch size a "
                "constant (e.g. a batch-by-batch similarity matrix with arange(batch) labels, as a contrastive loss "
                "has, or a reshape to a fixed batch), so its samples are not computed each from itself alone and "
                "the batch cannot be split across GPUs")
    if not data_dependent(err):
        return f"torch.export cannot trace the model either{_at_line(err)} ({reason})"
    frame = user_frame(err)
    if frame is not None and _LAYERDROP.search(linecache.getline(*frame)):
        return (
            f"torch.export cannot trace a branch on a random draw{_at_line(err)} (LayerDrop): the layers would "
            "change from step to step unless its probability is 0 (e.g. encoder_layerdrop=0.0)"
        )
    return f"torch.export cannot trace a value-dependent branch{_at_line(err)}: the way it goes depends on the data"


def _what_fx_met(err: BaseException) -> str:
    """What in the model's code stopped torch.fx, in words ('' when not one of the known idioms)."""
    text = str(err)
    found = next((what for words, what in _FX_IDIOMS if words in text), "")
    return f"{found} " if found else ""


def placeholder_values(module: fx.GraphModule, named: Mapping[str, Any]) -> list[Any]:
    """The values of ``module``'s placeholders, in order: given inputs by name, else the defaults."""
    values = []
    for node in module.graph.nodes:
        if node.op != "placeholder":
            continue
        key = input_key(node)
        if isinstance(named.get(key), torch.Tensor) or (key in named and not node.args):
            values.append(named[key])
        elif node.args:
            values.append(node.args[0])
        else:
            raise DeeppoolError(f"inputs() gives no value for the model's input '{key}'")
    return values


def input_key(node: fx.Node) -> str:
    """The ``forward`` argument a placeholder stands for."""
    return str(node.target).lstrip("*")


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


class _Stopped(Exception):
    """A recorder reached the node it was asked to stop after."""


class _Recorder(fx.Interpreter):
    """Runs the graph (up to and including node ``until``, when given) and keeps every node's value, forward
    FLOPs and the tensors it mutated."""

    def __init__(self, module: fx.GraphModule, counter: FlopCounterMode, until: str | None = None) -> None:
        super().__init__(module)
        self.counter = counter
        self.until = until
        self.random = SampleRandomness(seed=0)
        self.values: dict[str, Any] = {}
        self.flops: dict[str, int] = {}
        self.mutated: dict[str, tuple[torch.Tensor, ...]] = {}
        self.first_random: dict[str, int] = {}
        self.at: fx.Node | None = None
        """The node running now (the one at fault when the run raises)."""

    def run_node(self, n: fx.Node) -> Any:
        self.at = n
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        inputs = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        versions = [tensor._version for tensor in inputs]
        before = self.counter.get_total_flops()
        ordinal = self.random.ordinal
        value = super().run_node(n)
        if self.random.ordinal > ordinal:
            self.first_random[n.name] = ordinal
        self.values[n.name] = value
        self.flops[n.name] = self.counter.get_total_flops() - before
        changed = tuple(t for t, version in zip(inputs, versions, strict=True) if t._version != version)
        if changed and n.op != "output":
            self.mutated[n.name] = changed
        if n.name == self.until:
            raise _Stopped
        return value

    @property
    def probe(self) -> Probe:
        return Probe(values=self.values, mutated=self.mutated)


class _ShapeOnly:
    """Runs ops for their shapes only: on ``meta`` tensors when the model was built
    on the meta device (fast), else under a :class:`FakeTensorMode`; with ``real``, on the real
    tensors themselves (a graph with opaque layers: eager code needs real values)."""

    def __init__(self, device: torch.device, *, real: bool = False) -> None:
        self.meta = device.type == "meta"
        if real and self.meta:
            raise DeeppoolError("a model with opaque layers (eager code inside a module) cannot be probed on meta")
        self.real = real
        self.fake = None if self.meta or real else FakeTensorMode(allow_non_fake_inputs=True)

    def __enter__(self) -> None:
        if self.fake is not None:
            self.fake.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.fake is not None:
            self.fake.__exit__(*exc)

    def tensor(self, value: torch.Tensor) -> torch.Tensor:
        if self.meta:
            return value.to("meta")
        if self.fake is None:
            return value

        return self.fake.from_tensor(value)


def _record(
    module: fx.GraphModule, named: Mapping[str, Any], shapes: _ShapeOnly, until: str | None = None,
) -> _Recorder:
    with FlopCounterMode(display=False) as counter:
        recorder = _Recorder(module, counter, until)
        _run(recorder, placeholder_values(module, named), shapes)
    return recorder


def _run(recorder: _Recorder, inputs: list[Any], shapes: _ShapeOnly) -> None:
    with shapes, torch.no_grad():
        try:
            fed = [shapes.tensor(t) if isinstance(t, torch.Tensor) else t for t in inputs]
            with recorder.random:
                recorder.run(*fed, enable_io_processing=False)
        except _Stopped:
            pass
        except Exception as err:
            reason = f"{type(err).__name__}: {_first_line(err)}"
            if data_dependent(err):  # in a module: it becomes an opaque layer; in the root: probed on real tensors
                inside = enclosing_module(recorder.at) if recorder.at is not None else None
                where = f"module '{inside}'" if inside is not None else "the model's own code"
                raise ModuleFailure(f"the traced model's shapes depend on data in {where} ({reason})",
                                    module=inside, reason=reason, retry_export=False) from None
            raise DeeppoolError(
                f"the traced model fails on its own inputs ({reason}): check inputs(batch_size) against model()"
            ) from None


def _device_of(module: nn.Module) -> torch.device:
    """Where the model's parameters live (``meta`` when it was built for planning only)."""
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def _batched(small: Mapping[str, Any], large: Mapping[str, Any]) -> set[str]:
    """Names of nodes whose value is a tensor with the batch in dimension 0."""
    return {
        name
        for name, value in small.items()
        if isinstance(value, torch.Tensor)
        and value.dim() > 0
        and isinstance(large.get(name), torch.Tensor)
        and (value.shape[0], large[name].shape[0]) == _PROBE_BATCHES
    }


def _graph_of(
    module: fx.GraphModule, loaded: LoadedModel, method: TraceMethod,
    branches: tuple[tuple[Branch, ...], tuple[Branch, ...]] = ((), ()),
    opaque: Mapping[str, ModuleFailure] | None = None,
) -> Traced:
    """Probe the graph; buffers (batch-norm running statistics) and gradients are restored after."""
    saved = {name: buffer.clone() for name, buffer in module.named_buffers()}
    grads = {name: param.grad for name, param in module.named_parameters()}
    try:
        try:
            return _probed_graph(module, loaded, method, branches, opaque or {})
        except ModuleFailure as failure:  # a data-dependent shape in the root's code: probe on real tensors
            if failure.module is not None or opaque or _device_of(module).type == "meta":
                raise
            return _probed_graph(module, loaded, method, branches, {}, real=True)
    finally:
        with torch.no_grad():
            for name, buffer in module.named_buffers():
                buffer.copy_(saved[name])
        for name, param in module.named_parameters():
            param.grad = grads[name]


def _probed_graph(
    module: fx.GraphModule, loaded: LoadedModel, method: TraceMethod,
    branches: tuple[tuple[Branch, ...], tuple[Branch, ...]], opaque: Mapping[str, ModuleFailure], *,
    real: bool = False,
) -> Traced:
    """Shapes and FLOPs come from meta or fake tensors, no arithmetic done; with opaque layers or ``real``,
    from real ones."""
    shapes = _ShapeOnly(_device_of(module), real=real or bool(opaque) or method is TraceMethod.REAL)
    small_inputs, large_inputs = (loaded.named_inputs(b) for b in _PROBE_BATCHES)
    probes: list[_Recorder] = []

    def probe(until: str | None) -> Probe:
        probes.append(_record(module, small_inputs, shapes, until))
        return probes[-1].probe

    _, mutations = functionalize(module, probe)
    small, large = probes[-1], _record(module, large_inputs, shapes)
    batched = _batched(small.values, large.values)
    sizes = dict(zip(_PROBE_BATCHES, (small.random.calls, large.random.calls), strict=True))
    random = RandomSites(first=small.first_random, batched=batched_calls(sizes))
    nodes = list(module.graph.nodes)
    _check_opaque_rows(module, nodes, small, opaque)
    placeholders = _placeholders(nodes, small.values, batched)
    data = _from_data(nodes, {n.name for n in placeholders}, small.values)
    indices = _row_indices(nodes, data)
    heads = [n for n in nodes if n.op in _LAYER_OPS and n.name in batched and n.name in data and n.name not in indices]
    groups = _merge(_group(heads, method), mutations, nodes)
    groups = _carry_buffer_updates(groups, nodes, module, data, small.mutated)
    with FlopCounterMode(display=False) as counter:
        builder = _LayerBuilder(module, small, {n.name for n in placeholders}, groups, shapes, counter, opaque)
        layers = [builder.build(group) for group in groups]
        output = _output_layer(nodes, builder.layer_of, small.values, module)
        if output is None:
            layers.append(builder.build_output(nodes[-1]))
            output = OUTPUT_LAYER
    graph = LayerGraph(
        layers=tuple(layers),
        inputs=tuple(n.name for n in placeholders),
        input_keys=tuple(input_key(n) for n in placeholders),
        input_shapes=tuple(tuple(small.values[n.name].shape[1:]) for n in placeholders),
        output=output,
        method=method,
        branches=branches[0],
        draws=branches[1],
    )
    return Traced(module=module, graph=graph, random=random)


def _row_indices(nodes: list[fx.Node], data: set[str]) -> set[str]:
    """Nodes whose values are positions in the batch (``nonzero``'s rows, and views of them): glue, recomputed
    by each layer that reads them, since a rank's positions are not the whole batch's; the layer that
    gathers with them (``torch.gather(logits, 0, index)``) gives each of its samples what one process does."""
    found: set[str] = set()
    for node in nodes:
        name = getattr(node.target, "__name__", str(node.target))
        from_data = [arg for arg in node.all_input_nodes if arg.name in data]
        if name.removesuffix(".default") in _INDEX_OPS or (from_data and all(a.name in found for a in from_data)):
            found.add(node.name)
    return found


def _check_opaque_rows(module: fx.GraphModule, nodes: list[fx.Node], probe: _Recorder,
                       opaque: Mapping[str, ModuleFailure]) -> None:
    """Each opaque layer that draws no random numbers gives every probed sample the same output alone."""
    for node in nodes:
        if node.op != "call_module" or str(node.target) not in opaque or node.name in probe.first_random:
            continue
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: probe.values[n.name])
        why = str(opaque[str(node.target)])

        def failed(text: str, why: str = why) -> DeeppoolError:
            return DeeppoolError(f"{why}; {text}")

        check_rows(str(node.target), module.get_submodule(str(node.target)), args, kwargs, _PROBE_BATCHES[0], failed)


def _carry_buffer_updates(
    groups: list[list[fx.Node]], nodes: list[fx.Node], module: fx.GraphModule, data: set[str],
    mutated: Mapping[str, tuple[torch.Tensor, ...]],
) -> list[list[fx.Node]]:
    """Put every update of a buffer in forward into a layer, or refuse one that splitting would change.

    An update that reads no sample (``num_batches_tracked += 1``, a step counter) joins the
    layer after it: every rank that runs that layer updates its copy, as one process does. An
    update computed from the batch's values (a hand-written running mean of ``x.mean(0)``) would
    see only a rank's slice of the batch, so it is refused here, naming the buffer; BatchNorm's
    (``torch.batch_norm``) the executor synchronises.
    """
    names = {id(buffer): name for name, buffer in module.named_buffers()}
    covered = _covered(groups)
    order = {node.name: index for index, node in enumerate(nodes)}
    for node in nodes:
        updated = _updated_buffers(node, module, names, mutated.get(node.name, ()))
        if not updated or "batch_norm" in str(node.target) or _writes_back_itself(node):
            continue
        if any(arg.name in data for arg in node.all_input_nodes):
            raise DeeppoolError(
                f"buffer '{updated[0]}' is updated in forward from the batch's values ('{node.name}' in module "
                f"'{_module_path(node) or type(module).__name__}'): split across GPUs each rank would see only "
                "its samples; make it an nn.BatchNorm, or update it outside forward"
            )
        if node.name in covered:
            continue
        after = next((group for group in groups if order[group[-1].name] > order[node.name]), None)
        if after is None:
            raise DeeppoolError(f"buffer '{updated[0]}' is updated in forward after the model's last layer")
        after.insert(next(i for i, member in enumerate(after) if order[member.name] > order[node.name]), node)
    return groups


def _writes_back_itself(node: fx.Node) -> bool:
    """torch.export's closing ``copy_(buffer, value)`` where ``value`` is the buffer updated in place: a no-op."""
    if node.target is not torch.ops.aten.copy_.default or len(node.args) < 2:
        return False
    value = node.args[1]
    while isinstance(value, fx.Node) and value is not node.args[0] and _in_place(value) and value.args:
        value = value.args[0]
    return value is node.args[0]


def _covered(groups: list[list[fx.Node]]) -> set[str]:
    """The groups' nodes and every node they read: what the layers will run."""
    stack = [node for group in groups for node in group]
    seen = {node.name for node in stack}
    while stack:
        for arg in stack.pop().all_input_nodes:
            if arg.name not in seen:
                seen.add(arg.name)
                stack.append(arg)
    return seen


def _updated_buffers(
    node: fx.Node, module: fx.GraphModule, names: Mapping[int, str], changed: tuple[torch.Tensor, ...],
) -> list[str]:
    """The buffers ``node`` updates in place: seen changing in the probe, or passed to an in-place op."""
    found = [names[id(tensor)] for tensor in changed if id(tensor) in names]
    if node.op in ("call_function", "call_method") and _in_place(node):
        for arg in node.all_input_nodes:
            if arg.op == "get_attr":
                value = _attr(module, str(arg.target))
                if id(value) in names and not isinstance(value, nn.Parameter):
                    found.append(names[id(value)])
    return list(dict.fromkeys(found))


def _in_place(node: fx.Node) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return bool(target._schema.is_mutable)
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    return name.endswith("_") and not name.endswith("__") or name in ("setitem", "iadd", "isub", "imul", "itruediv")


def _from_data(nodes: list[fx.Node], inputs: set[str], values: Mapping[str, Any]) -> set[str]:
    """Nodes computed from the inputs' values (through tensors; a size read carries no data).

    The others (``arange(batch)``, ``zeros(b, d)``: made from sizes and
    constants) may follow the batch but carry no sample's data, so every reader
    recomputes them for its own rows rather than receiving another rank's.
    """
    found = set(inputs)
    for node in nodes:
        holds_tensor = any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(values.get(node.name)))
        if holds_tensor and any(arg.name in found for arg in node.all_input_nodes):
            found.add(node.name)
    return found


def _placeholders(nodes: list[fx.Node], values: Mapping[str, Any], batched: set[str]) -> list[fx.Node]:
    """The tensor inputs; each must carry the batch in dimension 0."""
    found = []
    for node in nodes:
        if node.op == "placeholder" and isinstance(values.get(node.name), torch.Tensor):
            if node.name not in batched:
                raise DeeppoolError(
                    f"input '{input_key(node)}' has shape {tuple(values[node.name].shape)} for a batch of "
                    f"{_PROBE_BATCHES[0]}: inputs(batch_size) must put the batch in dimension 0 of every tensor"
                )
            found.append(node)
    return found


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


def _merge(groups: list[list[fx.Node]], mutations: list[Mutation], nodes: list[fx.Node]) -> list[list[fx.Node]]:
    """Join the groups that a mutated tensor's producer, views and mutators fall in (one layer each)."""
    index = {node.name: i for i, group in enumerate(groups) for node in group}
    parent = list(range(len(groups)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for members in merged_groups(mutations):
        found = sorted({root(index[name]) for name in members if name in index})
        for other in found[1:]:
            parent[other] = found[0]
    order = {node.name: i for i, node in enumerate(nodes)}
    joined: dict[int, list[fx.Node]] = {}
    for i, group in enumerate(groups):
        joined.setdefault(root(i), []).extend(group)
    return sorted(
        (sorted(group, key=lambda n: order[n.name]) for group in joined.values()),
        key=lambda group: order[group[-1].name],
    )


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
        opaque: Mapping[str, ModuleFailure],
    ) -> None:
        self.module = module
        self.opaque = opaque
        self.shapes = shapes
        self.counter = counter
        self.values = probe.values
        self.forward_flops = probe.flops
        self.placeholders = placeholders
        self.layer_of = {node.name: group[-1].name for group in groups for node in group}
        self.order = {node.name: index for index, node in enumerate(module.graph.nodes)}
        self.by_name = {node.name: node for node in module.graph.nodes}
        self.canonical = {id(param): name for name, param in module.named_parameters()}
        self.counted: set[str] = set()

    def build(self, group: list[fx.Node]) -> Layer:
        head = group[-1]
        names, inputs = self._members(group)
        params = self._params(names)
        value = self.values[head.name]
        named = _named_node(head)
        fwd, bwd = self._flops(names, inputs, head)
        return Layer(
            name=head.name,
            op=self._op(named, params),
            target=self._target(named),
            nodes=names,
            inputs=inputs,
            output_shape=tuple(value.shape[1:]),
            dtype=str(value.dtype).removeprefix("torch."),
            params=params,
            param_bytes=self._param_bytes(params),
            act_bytes=value[0].numel() * value.element_size(),
            fwd_flops=fwd / _PROBE_BATCHES[0],
            bwd_flops=bwd / _PROBE_BATCHES[0],
            channels_last=_channels_last(value),
            opaque=self._opaque(named),
        )

    def _opaque(self, head: fx.Node) -> str:
        """Why ``head`` is an opaque submodule's call ('' when it is not one)."""
        failure = self.opaque.get(str(head.target)) if head.op == "call_module" else None
        return failure.reason if failure is not None else ""

    def build_output(self, output: fx.Node) -> Layer:
        """The layer that computes the model's whole output structure from the layers it reads."""
        names, inputs = self._members([output])
        params = self._params(names)
        fwd, bwd = self._flops(names, inputs, output)
        return Layer(
            name=output.name, op="output", target="output", nodes=names, inputs=inputs, output_shape=(),
            dtype="", params=params, param_bytes=self._param_bytes(params), act_bytes=0,
            fwd_flops=fwd / _PROBE_BATCHES[0], bwd_flops=bwd / _PROBE_BATCHES[0],
        )

    def _members(self, group: list[fx.Node]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The group's nodes with the glue it recomputes, in order, and the layers and inputs it reads."""
        members: set[str] = {node.name for node in group}
        inputs: list[str] = []
        for node in group:
            self._collect(node, members, inputs, set(members))
        return tuple(sorted(members, key=self.order.__getitem__)), tuple(inputs)

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
        """The parameters the nodes use, each by its canonical name (a shared one has one name)."""
        found: dict[str, None] = {}
        for name in names:
            node = self.by_name[name]
            if node.op == "call_module":
                for param in self.module.get_submodule(str(node.target)).parameters():
                    found[self.canonical[id(param)]] = None
            elif node.op == "get_attr":
                value = _attr(self.module, str(node.target))
                if isinstance(value, nn.Parameter):
                    found[self.canonical[id(value)]] = None
        return tuple(found)

    def _param_bytes(self, params: tuple[str, ...]) -> int:
        """Bytes of the parameters no earlier layer has counted (a shared one counts once)."""
        total = 0
        for name in params:
            if name not in self.counted:
                self.counted.add(name)
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
            outputs = floating_leaves(runner(*args))
            before = self.counter.get_total_flops()
            if outputs:
                torch.autograd.backward(outputs, [torch.ones_like(t) for t in outputs])
            backward = self.counter.get_total_flops() - before
        return float(forward), float(backward)


def _named_node(head: fx.Node) -> fx.Node:
    """The node a layer is named after: for a mutation's result node, the mutation."""
    if head.op == "call_function" and head.target is after_mutation:
        return head.args[1]
    return head


def _grad_input(value: torch.Tensor) -> torch.Tensor:
    copy = value.detach().clone()
    return copy.requires_grad_(copy.is_floating_point())


def _attr(module: nn.Module, dotted: str) -> torch.Tensor:
    value: Any = module
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _output_layer(nodes: list[fx.Node], layer_of: dict[str, str], values: Mapping[str, Any],
                  module: fx.GraphModule) -> str | None:
    """The layer whose tensor the model returns, or None when the output is a structure."""
    output = nodes[-1]
    result = pytree.tree_leaves(output.args[0])
    if not isinstance(structured_output(module, values[output.name]), torch.Tensor) or len(result) != 1:
        return None
    node = result[0]
    if not isinstance(node, fx.Node) or layer_of.get(node.name) != node.name:
        return None
    return node.name


def _channels_last(value: torch.Tensor) -> bool:
    """Whether a probed output is laid out channels-last (NHWC or NDHWC strides) and not also contiguous."""
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    layout = formats.get(value.dim())
    return layout is not None and not value.is_contiguous() and value.is_contiguous(memory_format=layout)
