"""The background's training step as CUDA graphs of about ``piece_ms`` each, cut at layer boundaries.

``--mux priority`` (:mod:`deeppool.multiplex.gpu`) replays these *pieces* one at a time inside idle
windows, as DeepPool's runtime replays the pieces ``GraphPieces.cpp`` cuts from its background's graph
(``be_graph_split_ms``, 0.5 ms). A step is: forward pieces, backward pieces (the layers in reverse), and
the optimizer step (with ``zero_grad``), uncut.

**Why each piece is captured on its own.** PyTorch cannot cut a captured graph (``torch.cuda.CUDAGraph``
exposes no nodes; DeepPool cuts the ``cudaGraph_t`` in C++), so each piece is its own capture, as
``torch.cuda.make_graphed_callables`` captures a module's forward and backward apart. Autograd is cut
into *segments* of consecutive layers: a segment's forward reads every value from an earlier segment
through a *leaf* (``detach().requires_grad_()``), so its autograd graph ends at its own inputs, and its
backward is ``torch.autograd.grad`` of its outputs (given the gradients later segments computed for
them) with respect to those leaves and its parameters. Parameter gradients are added into ``p.grad``
(static tensors, zeroed by the optimizer piece); a value's gradient is kept in a static buffer, summed
over the segments that read it (a copy first when more than one does, so that no addition writes into
another buffer it may alias). The saved activations are the forward graphs' static outputs, which the
backward graphs read. All pieces share one memory pool and are captured in the order they replay
(each micro-step's forward pieces, its backward pieces, then the step), the condition under which a shared
pool is safe.

**Sizing.** The step is first captured one layer per graph (each layer's forward, and its backward
apart) and timed over :data:`ROUNDS` steps replayed back to back (the minimum of each graph's device
times; on the fake GPU, its modelled time). When one layer phase of the whole batch is longer than
``piece_ms``, the step is cut into *micro-steps* of fewer rows (:func:`rows_for`: as many as keep that
phase within the target in proportion, at least one; gradients accumulate, each micro-step's loss
weighted by its share of the batch, as :meth:`BackgroundJob.micro_step` does) and timed again so.
Forward pieces are cut over the layers' forward times, backward pieces over their backward times from
the last layer, each closed before it would pass ``piece_ms`` (:func:`cut`); autograd is cut wherever
either is. The step is then captured again, piece by piece, and the per-layer graphs are freed. Each
timing round is a real training step on the captured (static) batch.

The arithmetic is the uncut step's in the same micro-steps (the whole batch's when no layer is longer
than a piece): the same kernels on the same values, a parameter's gradient ``0 + g``; only a value read
by three or more segments may sum its gradients in another order. A model that neither torch.fx nor
``torch.export`` traces, or whose traced graph does not hold the job's own parameters, is one layer.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_leaves, tree_map

from deeppool.device.seam import Event, Gpu, Graph, Stream
from deeppool.model.layer_exec import compile_layers, outside_inputs, structured_output
from deeppool.model.loading import LoadedModel, bind_inputs
from deeppool.model.trace import Traced, trace
from deeppool.multiplex.job import BackgroundJob, _slice, forward

WARMUP_STEPS = 3
"""Eager steps before any capture (one-time initialisation: autograd, the allocator, cuBLAS)."""
ROUNDS = 5
"""Steps of the one-layer-per-graph capture that time each layer (the minimum of each is kept)."""
HISTORY = 5
"""Replays a piece's expected length is the median of."""
STALE = 3
"""Windows in a row a piece timed only in the timing steps may be refused before it is tried once."""

INPUTS, TARGETS, SHARE, LOSS = "<inputs>", "<targets>", "<share>", "<loss>"
"""Value names no traced layer has: the batch's inputs (untraced model), its targets, a micro-step's share of
the batch (its loss's weight), the loss."""

FORWARD, BACKWARD, STEP = "forward", "backward", "step"


def cut(ms: Sequence[float], target_ms: float) -> list[range]:
    """Consecutive groups of ``ms``'s indices, each closed before its sum would pass ``target_ms``.

    Every group is at most ``target_ms`` long unless it is one item longer than that, and two neighbours
    together are longer than it (so there are fewer than twice as many groups as the fewest possible).
    """
    groups: list[range] = []
    start, total = 0, 0.0
    for index, length in enumerate(ms):
        if index > start and total + length > target_ms:
            groups.append(range(start, index))
            start, total = index, 0.0
        total += length
    if len(ms) > start:
        groups.append(range(start, len(ms)))
    return groups


def segments_of(forward_groups: Sequence[range], backward_groups: Sequence[range], units: int) -> list[range]:
    """Autograd's cuts: wherever a forward or a backward piece starts."""
    starts = sorted({0, *(g.start for g in forward_groups), *(g.start for g in backward_groups)} - {units})
    return [range(a, b) for a, b in zip(starts, [*starts[1:], units], strict=True)]


@dataclass(frozen=True, eq=False)
class Unit:
    """One layer of the background model (or its loss): the values it reads, and its parameters."""

    name: str
    reads: tuple[str, ...]
    run: Callable[..., Any]
    params: tuple[torch.nn.Parameter, ...]


@dataclass(frozen=True, eq=False)
class Layering:
    """The step's units in order (the model's layers, then the loss) and how the batch names its values."""

    units: tuple[Unit, ...]
    bind: Callable[[Any], dict[str, Any]]
    """The batch's inputs as the units' values by name."""
    traced: bool


def trace_background(loaded: LoadedModel) -> Traced | None:
    """The model's layers, traced on CPU before the job moves it to its device; None when it cannot be traced
    (it then runs as one layer). The process's RNG is left as it was: the foreground shares it."""
    try:
        with torch.random.fork_rng(devices=[]):
            return trace(loaded)
    except Exception:  # noqa: BLE001  any model tracing refuses still trains, in coarser pieces
        return None


def layering(job: BackgroundJob, traced: Traced | None) -> Layering:
    """The job's units: its traced layers when their graph holds the job's own parameters and buffers."""
    def loss(output: Any, targets: Any, share: float) -> torch.Tensor:
        return job.loaded.loss(output, targets) * share  # as BackgroundJob.micro_step weighs it

    if traced is None or not _shares_state(traced.module, job.module):
        whole = Unit(name="model", reads=(INPUTS,), run=lambda inputs: forward(job.module, inputs),
                     params=tuple(job.module.parameters()))
        return Layering(units=(whole, Unit(name=LOSS, reads=("model", TARGETS, SHARE), run=loss, params=())),
                        bind=lambda inputs: {INPUTS: inputs}, traced=False)
    graph, module = traced.graph, traced.module
    units = [_layer_unit(module, layer) for layer in graph.layers]
    units.append(Unit(name=LOSS, reads=(graph.output, TARGETS, SHARE), run=loss, params=()))

    def bind(inputs: Any) -> dict[str, Any]:
        named = bind_inputs(job.module, inputs)
        return {name: named.get(key) for name, key in zip(graph.inputs, graph.input_keys, strict=True)}

    return Layering(units=tuple(units), bind=bind, traced=True)


def _layer_unit(module: torch.fx.GraphModule, layer: Any) -> Unit:
    last = next(node for node in module.graph.nodes if node.name == layer.nodes[-1])
    compiled = compile_layers(module, [layer], [last.name], name="Piece")

    def run(*inputs: Any) -> Any:
        (value,) = compiled(*inputs)
        return structured_output(module, value) if last.op == "output" else value

    return Unit(name=layer.name, reads=outside_inputs([layer]), run=run, params=tuple(compiled.parameters()))


def _shares_state(traced: torch.nn.Module, own: torch.nn.Module) -> bool:
    mine = {id(t) for t in (*own.parameters(), *own.buffers())}
    return all(id(t) in mine for t in (*traced.parameters(), *traced.buffers()))


def _leaf(value: Any) -> Any:
    """``value`` with each tensor that needs a gradient replaced by a leaf over the same memory."""
    return tree_map(lambda t: t.detach().requires_grad_() if isinstance(t, torch.Tensor) and t.requires_grad
                    else t, value)


def _grad_tensors(value: Any) -> list[torch.Tensor | None]:
    return [t if isinstance(t, torch.Tensor) and t.requires_grad else None for t in tree_leaves(value)]


class Segments:
    """One micro-step's capture cut into segments: the static values, each segment's leaves and outputs, and the
    gradient buffers of the values crossing a cut. :meth:`forward` and :meth:`backward` run inside captures.

    A parameter used by several segments has their gradients summed first, in the order autograd would
    (the later layer's first), and then added into ``p.grad`` once, as autograd's ``AccumulateGrad`` adds
    the sum: a step of several micro-steps then accumulates as the uncut one does."""

    def __init__(self, layering: Layering, segments: Sequence[range], values: dict[str, Any]) -> None:
        self.units = layering.units
        self.segments = list(segments)
        self.values = dict(values)
        self.reads = [self._outside(s) for s in self.segments]
        self.readers = {name: sum(name in reads for reads in self.reads) for reads in self.reads for name in reads}
        self.params = [list({id(p): p for i in s for p in self.units[i].params if p.requires_grad}.values())
                       for s in self.segments]
        self.users: dict[int, int] = {}
        for used in self.params:
            for param in used:
                self.users[id(param)] = self.users.get(id(param), 0) + 1
        self.grads: dict[str, list[torch.Tensor | None]] = {}
        self.sums: dict[int, torch.Tensor] = {}
        self.pending: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        self.saved: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
        self.loss: torch.Tensor | None = None

    def _outside(self, segment: range) -> tuple[str, ...]:
        inside = {self.units[i].name for i in segment}
        return tuple(dict.fromkeys(r for i in segment for r in self.units[i].reads if r not in inside))

    def forward(self, index: int) -> None:
        leaves = {name: _leaf(self.values[name]) for name in self.reads[index]}
        local = dict(leaves)
        for unit in (self.units[i] for i in self.segments[index]):
            local[unit.name] = self.values[unit.name] = unit.run(*(local[name] for name in unit.reads))
        self.saved[index] = (leaves, {self.units[i].name: local[self.units[i].name] for i in self.segments[index]})
        if LOSS in local:
            self.loss = local[LOSS]

    def has_backward(self, index: int) -> bool:
        """Whether a gradient reaches the segment (the loss, or a later segment's gradient for its outputs)."""
        return any(self.units[i].name == LOSS or self.units[i].name in self.grads for i in self.segments[index])

    def backward(self, index: int) -> None:
        leaves, outputs = self.saved.pop(index)
        outs: list[torch.Tensor] = []
        given: list[torch.Tensor | None] = []
        for name, value in outputs.items():
            if name == LOSS:
                outs.append(value)
                given.append(None)
                continue
            for tensor, grad in zip(_grad_tensors(value), self.grads.get(name, ()), strict=False):
                if tensor is not None and grad is not None:
                    outs.append(tensor)
                    given.append(grad)
        wanted = [(name, i, t) for name, value in leaves.items() for i, t in enumerate(_grad_tensors(value))
                  if t is not None]
        params = self.params[index]
        got: Sequence[torch.Tensor | None] = [None] * (len(wanted) + len(params))
        if outs:  # inside a capture
            self.flush()
            got = torch.autograd.grad(outs, [t for *_, t in wanted] + params, given, allow_unused=True)
            for (name, i, _), grad in zip(wanted, got, strict=False):
                if grad is not None:
                    self._add(name, i, grad)
        for param, grad in zip(params, got[len(wanted):], strict=True):
            self._param(param, grad)
        if outs:
            self.flush()
        for name in leaves:
            self.readers[name] -= 1

    def _param(self, param: torch.nn.Parameter, grad: torch.Tensor | None) -> None:
        self.users[id(param)] -= 1
        total = self.sums.pop(id(param), None)
        if grad is not None:
            total = grad if total is None else total + grad
        if total is not None and self.users[id(param)] == 0:
            self.pending.append((param, total))
        elif total is not None:
            self.sums[id(param)] = total

    def flush(self) -> None:
        """Add the parameters' finished gradient sums into ``p.grad`` (static, made before capture): inside a
        capture, so a sum finished by a segment that ran no backward waits for the next one, or the step."""
        for param, total in self.pending:
            param.grad.add_(total)  # type: ignore[union-attr]
        self.pending.clear()

    def _add(self, name: str, index: int, grad: torch.Tensor) -> None:
        buffers = self.grads.setdefault(name, [None] * len(tree_leaves(self.values[name])))
        if buffers[index] is None:
            buffers[index] = grad if self.readers[name] == 1 else grad.clone()
        else:
            buffers[index].add_(grad)  # type: ignore[union-attr]


@dataclass
class StepPieces:
    """The step's graphs in replay order (per micro-step: forward pieces, backward pieces; then the optimizer
    step), each with its kind, its layers, its micro-step and its expected length; the micro-steps' static
    losses (each weighted by its share of the batch), read once a step's last piece has completed."""

    graphs: list[Graph]
    ms: list[float]
    planned_ms: tuple[float, ...]
    kinds: tuple[str, ...]
    layers: tuple[tuple[str, ...], ...]
    micro: tuple[int, ...]
    """Each piece's micro-step (the optimizer step: the last one's)."""
    rows: int
    """Rows of the batch per micro-step (the last may have fewer)."""
    losses: list[torch.Tensor]
    keep: list[Segments]
    """The static tensors the graphs read and write: alive as long as the graphs."""
    history: list[list[float]] = field(default_factory=list)
    refused: list[int] = field(default_factory=list)

    def fits(self, index: int, left_s: float) -> bool:
        """Whether piece ``index`` is expected to end within ``left_s`` seconds.

        Its first expected length comes from the timing steps, which ran beside the foreground (at a lower
        priority) and may be inflated by it: a piece never yet replayed in a window that has been refused in
        :data:`STALE` windows in a row is tried once, so that no such estimate keeps the background out
        for good. Once replayed, its replays decide."""
        if self.ms[index] / 1e3 <= left_s:
            return True
        if left_s <= 0 or (self.history and len(self.history[index]) > 1):
            return False
        self.refused = self.refused or [0] * len(self.graphs)
        self.refused[index] += 1
        return self.refused[index] > STALE

    def measured(self, index: int, ms: float) -> None:
        """A piece's expected length: the median of its last few replays and the first estimate, so one
        slow replay (longer than every window) does not keep the piece, and the background, out for good."""
        if not self.history:
            self.history = [[first] for first in self.ms]
        recent = self.history[index] = [*self.history[index][-(HISTORY - 1):], ms]
        self.ms[index] = statistics.median(recent)

    def step_loss(self) -> float:
        """The last replayed step's loss (read once its pieces have completed)."""
        return sum(float(loss.detach()) for loss in self.losses)


@dataclass(frozen=True)
class _Plan:
    """Which segments each forward and each backward piece captures (backward: in replay order)."""

    segments: list[range]
    forward: list[list[int]]
    backward: list[list[int]]

    @classmethod
    def per_unit(cls, units: int) -> _Plan:
        return cls(segments=[range(i, i + 1) for i in range(units)], forward=[[i] for i in range(units)],
                   backward=[[i] for i in reversed(range(units))])


@dataclass
class _Captured:
    """Graphs captured into one pool, in replay order: each with its kind, its span of units, its micro-step."""

    gpu: Gpu
    stream: Stream
    pool: Any
    graphs: list[Graph] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    spans: list[range] = field(default_factory=list)
    micro: list[int] = field(default_factory=list)
    states: list[Segments] = field(default_factory=list)

    def _piece(self, kind: str, span: range, run: Callable[[], None]) -> None:
        graph = self.gpu.graph()
        with self.gpu.capture(graph, self.stream, self.pool):
            run()
        self.graphs.append(graph)
        self.kinds.append(kind)
        self.spans.append(span)
        self.micro.append(max(0, len(self.states) - 1))

    def micro_step(self, state: Segments, plan: _Plan) -> None:
        """One micro-step's forward pieces, then its backward pieces."""
        self.states.append(state)

        def run(group: list[int], each: Callable[[int], None]) -> Callable[[], None]:
            def segments() -> None:
                for index in group:
                    each(index)

            return segments

        def span(group: list[int]) -> range:
            units = [u for index in group for u in plan.segments[index]]
            return range(min(units), max(units) + 1)

        for group in plan.forward:
            self._piece(FORWARD, span(group), run(group, state.forward))
        for group in plan.backward:
            if any(state.has_backward(index) for index in group):
                self._piece(BACKWARD, span(group), run(group, state.backward))
            else:
                for index in group:
                    state.backward(index)  # nothing to differentiate: its leaves only stop waiting for it

    def optimizer_step(self, job: BackgroundJob) -> None:
        def step() -> None:
            for state in self.states:
                state.flush()
            job.optimizer.step()
            job.optimizer.zero_grad(set_to_none=False)

        self._piece(STEP, range(0), step)

    def losses(self) -> list[torch.Tensor]:
        return [state.loss for state in self.states if state.loss is not None]


def _timed(gpu: Gpu, job: BackgroundJob, stream: Stream, captured: _Captured) -> list[float]:
    """Replay the step :data:`ROUNDS` times back to back (each a training step) and give each graph's least
    device time. Events between graphs of a busy stream time the device, not the host's issue."""
    graphs, losses = captured.graphs, captured.losses()
    events: list[list[Event]] = [[gpu.event() for _ in range(len(graphs) + 1)] for _ in range(ROUNDS)]
    with gpu.use(stream):
        kept = [[torch.empty_like(loss) for loss in losses] for _ in range(ROUNDS)]
        for marks, copies in zip(events, kept, strict=True):
            marks[0].record(stream)
            for graph, mark in zip(graphs, marks[1:], strict=True):
                graph.replay()
                mark.record(stream)
            for copy, loss in zip(copies, losses, strict=True):
                copy.copy_(loss)  # the step's losses, before the next round writes them
    stream.synchronize()
    for copies in kept:
        job.losses.append(sum(float(copy.detach()) for copy in copies))
        job.step += 1
        job.samples += job.batch
    return [min(marks[i].elapsed_time(marks[i + 1]) for marks in events) for i in range(len(graphs))]


def _unit_ms(captured: _Captured, ms: list[float], units: int) -> list[tuple[list[float], list[float]]]:
    """Each micro-step's forward and backward time of every unit (0 where a unit has no backward)."""
    times = [([0.0] * units, [0.0] * units) for _ in captured.states]
    for kind, span, micro, length in zip(captured.kinds, captured.spans, captured.micro, ms, strict=True):
        if kind != STEP:
            for unit in span:
                times[micro][0 if kind == FORWARD else 1][unit] = length
    return times


def _cut_plan(forward_ms: list[float], backward_ms: list[float], piece_ms: float) -> _Plan:
    units = len(forward_ms)
    forward_groups = cut(forward_ms, piece_ms)
    backward_groups = [range(units - g.stop, units - g.start) for g in cut(backward_ms[::-1], piece_ms)]
    segments = segments_of(forward_groups, backward_groups, units)
    index = {s.start: i for i, s in enumerate(segments)}

    def members(group: range) -> list[int]:
        return [index[s.start] for s in segments if s.start in group]

    return _Plan(segments=segments, forward=[members(g) for g in forward_groups],
                 backward=[members(g)[::-1] for g in backward_groups])


def rows_for(longest_ms: float, batch: int, piece_ms: float) -> int:
    """Rows per micro-step: the whole batch when its longest layer phase fits ``piece_ms``; else as many rows as
    keep that phase within it, estimated in proportion to the rows, and at least one."""
    if longest_ms <= piece_ms:
        return batch
    return max(1, min(batch, math.floor(batch * piece_ms / longest_ms)))


def _micro_steps(batch: int, rows: int) -> list[range]:
    return [range(first, min(first + rows, batch)) for first in range(0, batch, rows)]


class _Step:
    """The job, its units and its static batch: each micro-step's values, and captures of the whole step."""

    def __init__(self, gpu: Gpu, job: BackgroundJob, stream: Stream, traced: Traced | None) -> None:
        self.gpu, self.job, self.stream = gpu, job, stream
        self.layering = layering(job, traced)
        with gpu.use(stream):
            self.inputs, self.targets = job._batch()

    def values(self, rows: range) -> dict[str, Any]:
        with self.gpu.use(self.stream):  # slices of the static batch: views, made on the stream that uses them
            inputs = _slice(self.inputs, rows.start, rows.stop)
            targets = _slice(self.targets, rows.start, rows.stop)
        return {**self.layering.bind(inputs), TARGETS: targets, SHARE: len(rows) / self.job.batch}

    def capture(self, micro_steps: list[range], plans: list[_Plan]) -> _Captured:
        captured = _Captured(self.gpu, self.stream, self.gpu.graph_pool())
        for rows, plan in zip(micro_steps, plans, strict=True):
            captured.micro_step(Segments(self.layering, plan.segments, self.values(rows)), plan)
        captured.optimizer_step(self.job)
        return captured

    def timed(self, micro_steps: list[range]) -> tuple[list[tuple[list[float], list[float]]], float]:
        """Each micro-step's unit times (forward, backward) and the optimizer step's, over :data:`ROUNDS` steps
        of one graph per unit; the graphs are freed after."""
        captured = self.capture(micro_steps, [_Plan.per_unit(len(self.layering.units))] * len(micro_steps))
        ms = _timed(self.gpu, self.job, self.stream, captured)
        return _unit_ms(captured, ms, len(self.layering.units)), ms[-1]


def capture(gpu: Gpu, job: BackgroundJob, stream: Stream, piece_ms: float, traced: Traced | None) -> StepPieces:
    """Warm up, time every layer, cut the step into pieces of about ``piece_ms`` (in micro-steps of fewer rows
    where a layer at the whole batch is longer) and capture each."""
    stream.wait_stream(gpu.current_stream(job.device))  # the model and its data were made on the current stream
    with gpu.use(stream):
        for _ in range(WARMUP_STEPS):
            job.train_step()
        for p in job.module.parameters():
            p.grad = torch.zeros_like(p)
    step = _Step(gpu, job, stream, traced)
    micro_steps = [range(job.batch)]
    times, step_ms = step.timed(micro_steps)
    rows = rows_for(max(max(f + b) for f, b in times), job.batch, piece_ms)
    if rows < job.batch:  # a layer at the whole batch is longer than a piece: time it in micro-steps of rows
        micro_steps = _micro_steps(job.batch, rows)
        times, step_ms = step.timed(micro_steps)
    plans = [_cut_plan(forward_ms, backward_ms, piece_ms) for forward_ms, backward_ms in times]
    captured = step.capture(micro_steps, plans)
    planned = [step_ms if kind == STEP else sum(times[micro][0 if kind == FORWARD else 1][u] for u in span)
               for kind, span, micro in zip(captured.kinds, captured.spans, captured.micro, strict=True)]
    return StepPieces(graphs=captured.graphs, ms=list(planned), planned_ms=tuple(planned),
                      kinds=tuple(captured.kinds), micro=tuple(captured.micro), rows=rows,
                      layers=tuple(tuple(step.layering.units[u].name for u in span) for span in captured.spans),
                      losses=captured.losses(), keep=captured.states)
