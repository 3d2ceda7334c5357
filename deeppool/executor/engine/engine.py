"""One rank's training iteration: run its :class:`Program` op by op, a stage at a time.

Each stage runs as one compiled module on leaf copies of the values it reads
from other stages, so its backward is one ``torch.autograd.backward`` call and
the gradients of its inputs can be sent back to the ranks that produced them.
The loss on rank ``r`` of the output layer is scaled by ``n_r / B`` (and by
``1/K`` for ``K`` micro-batches), so the per-rank gradients *sum* to the
gradient of the global mean loss; gradient all-reduces therefore sum.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from deeppool.adaptation.kfac import KFACPreconditioner
from deeppool.executor.engine.comm import Comm
from deeppool.executor.engine.data import Batch
from deeppool.executor.engine.faults import Slowdown
from deeppool.executor.engine.gradients import GradientReducer
from deeppool.executor.engine.idle import IdleListener, IdleWindowEvent
from deeppool.executor.engine.local_model import LocalModel
from deeppool.executor.engine.monitor import AdaScaleLr, GradientMonitor
from deeppool.executor.engine.overlap import StageOverlap, install_hooks
from deeppool.executor.engine.precision import MixedPrecision
from deeppool.executor.engine.program import Op, OpKind, Program, Stage, Transfer
from deeppool.executor.engine.timing import Category, Recorder, Span
from deeppool.model.graph import grad_flows
from deeppool.plans import IdleWindow, Plan, PlannedLayer

LossFn = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]

_COMM = {OpKind.RESHARD, OpKind.RESHARD_GRAD, OpKind.ALLREDUCE}
_FORWARD = {OpKind.RESHARD, OpKind.FORWARD}


@dataclass
class _State:
    """What one iteration keeps between ops."""

    batch: Batch
    step: int
    micro: int = 0
    """The micro-batch within the optimizer step (``--accumulate``)."""
    micros: int = 1
    position: int = 0
    """The global batch the optimizer step's first micro-batch is (``step × micros`` while K is fixed)."""
    sync: bool = True
    """False: gradients stay local, as under DDP's ``no_sync()`` (a later step reduces their sum)."""
    outputs: dict[str, Any] = field(default_factory=dict)
    leaves: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict)
    """The stage's leaf copy of an outside producer's output, by (stage, producer)."""
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    loss: torch.Tensor | None = None

    @property
    def last(self) -> bool:
        """The optimizer step's last micro-batch: gradients are reduced and the optimizer steps."""
        return self.sync and self.micro == self.micros - 1

    @property
    def draw(self) -> int:
        """The position of this micro-batch's random draws: one per global batch trained on."""
        return self.position + self.micro


@dataclass(frozen=True, kw_only=True)
class Pending:
    """An iteration between :meth:`Engine.begin` and :meth:`Engine.end`."""

    state: _State
    start_s: float
    output: Any
    """This rank's rows of the model's output (None on a rank that computes none)."""


@dataclass(frozen=True, kw_only=True)
class EngineParts:
    """Everything an :class:`Engine` is wired from (all injected)."""

    plan: Plan
    program: Program
    model: LocalModel
    comm: Comm
    loss: LossFn
    optimizer: torch.optim.Optimizer | None
    reducer: GradientReducer
    recorder: Recorder
    idle: dict[int | None, IdleWindow]
    on_idle: IdleListener
    device: torch.device
    on_gradients: Callable[[int], None] | None = None
    """Called with the step once gradients are reduced, before the optimizer steps (``--check``)."""
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
    """Stepped after every optimizer step (``--lr-schedule``)."""
    clip_norm: float | None = None
    """Clip by the global gradient norm (``--clip-norm``), computed on rank 0, which holds every parameter."""
    synchronize: Callable[[], None] = lambda: None
    """Waits for the device (the device seam's ``synchronize`` on a GPU): only where an idle window closes,
    and once at the end of an iteration."""
    overlap: bool = True
    """Start gradient all-reduces during the backward (:mod:`deeppool.executor.engine.overlap`);
    off, each stage's gradients are handed over after its backward."""
    slowdown: Slowdown | None = None
    """An injected slow rank (``DEEPPOOL_FAULT=slow-rank:R``, :mod:`deeppool.executor.engine.faults`)."""
    monitor: GradientMonitor | None = None
    """Measures the gradient noise scale once gradients are reduced (``--monitor gns``); its meter is the
    reducer's."""
    lr_scaling: AdaScaleLr | None = None
    """Sets the learning rate before the optimizer steps (``--lr-scaling adascale``; then no ``scheduler``)."""
    preconditioner: KFACPreconditioner | None = None
    """K-FAC (``--optimizer kfac``): replaces the reduced gradients by preconditioned ones, after ``on_gradients``
    and before clipping (the norm clipped is the preconditioned gradient's, the one the optimizer steps on)."""
    precision: MixedPrecision = field(default_factory=MixedPrecision.fp32)
    """Autocast, the reshard dtypes it gives and fp16 loss scaling (:mod:`deeppool.executor.engine.precision`)."""
    pace: tuple[int, ...] | None = None
    """Rank 0 and the ranks that run no layer (:func:`~deeppool.executor.engine.program.pace_group`), when an idle
    listener is given: at each iteration's end rank 0 sends each of them one element and each waits for it,
    so its whole-iteration window closes when rank 0's iteration ends and its idle time is measured. None:
    no rank waits (a wholly idle rank runs ahead of the others)."""


class Engine:
    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        self.rank = parts.program.rank
        self.planned: dict[str, PlannedLayer] = {layer.name: layer for layer in parts.plan.layers}
        self.flows = grad_flows(parts.model.graph)
        graph = parts.model.graph
        self.placeholders = dict(zip(graph.inputs, graph.input_keys, strict=True))
        self.layers = {layer.name: layer for layer in parts.model.graph.layers}
        self.stages: dict[int, Stage] = {stage.index: stage for stage in parts.program.stages}
        self._open_idle: IdleWindowEvent | None = None
        self.overlaps = self._overlaps() if parts.overlap else {}
        steps = [op for op in parts.program.ops if op.kind is OpKind.STEP]
        self._backward_from = next((i for i, op in enumerate(parts.program.ops) if op.kind not in _FORWARD),
                                   len(parts.program.ops))
        """The first op that is not a forward one: every forward op comes before it (:mod:`.program`)."""
        self._last_step: Op | None = steps[-1] if steps else None
        self._handlers: dict[OpKind, Callable[[Op, _State], None]] = {
            OpKind.RESHARD: self._reshard,
            OpKind.FORWARD: self._forward,
            OpKind.LOSS: self._loss,
            OpKind.BACKWARD: self._backward,
            OpKind.ALLREDUCE: self._allreduce,
            OpKind.RESHARD_GRAD: self._reshard_grad,
            OpKind.STEP: self._layer_step,
        }
        slow = parts.slowdown
        if slow is not None and slow.rank == self.rank:
            for kind in (OpKind.FORWARD, OpKind.BACKWARD):
                self._handlers[kind] = slow.slowed(self._handlers[kind], parts.synchronize,
                                                   time.perf_counter if parts.device.type == "cuda" else time.thread_time)

    def step(self, step: int, batches: Sequence[Batch], position: int | None = None, *, sync: bool = True) -> float:
        """Run one optimizer step over ``batches`` (micro-batches, the first being global batch ``position``,
        ``step × len(batches)`` by default); returns this rank's share of the mean loss. ``sync=False``
        leaves the gradients local and unreduced, and steps nothing (:mod:`deeppool.library`'s ``no_sync``)."""
        recorder = self.parts.recorder
        recorder.begin(step)
        start = recorder.clock()
        loss = 0.0
        first = step * len(batches) if position is None else position
        for micro, batch in enumerate(batches):
            state = _State(batch=batch, step=step, micro=micro, micros=len(batches), position=first, sync=sync)
            self._fire(None, step, start)
            self._run(state, self.parts.program.ops, start)
            loss += float(state.loss.detach()) if state.loss is not None else 0.0
        self._end_iteration(step, start, sync)
        return loss

    def begin(self, step: int, batch: Batch, position: int, *, sync: bool = True) -> Pending:
        """The forward half of a one-batch :meth:`step` whose loss is computed outside the engine (a user's
        ``loss.backward()`` through :meth:`deeppool.library.Parallelized.forward`): the reshards and stage
        forwards, with autograd recording. :attr:`Pending.output` is this rank's rows of the model's output;
        :meth:`end` runs the rest of the iteration, from the output's gradient."""
        recorder = self.parts.recorder
        recorder.begin(step)
        state = _State(batch=batch, step=step, position=position, sync=sync)
        start = recorder.clock()
        self._fire(None, step, start)
        self._run(state, self.parts.program.ops[: self._backward_from], start)
        return Pending(state=state, start_s=start, output=state.outputs.get(self.parts.model.graph.output))

    def end(self, pending: Pending, output_grad: torch.Tensor | None) -> None:
        """The backward half: ``output_grad`` is the loss's gradient for this rank's rows of the output (None
        on a rank that computes none); the backwards, gradient reshards and all-reduces then run as in
        :meth:`step` (no loss op: the loss was the caller's)."""
        state = pending.state
        if output_grad is not None:
            state.grads[self.parts.model.graph.output] = output_grad
        ops = [op for op in self.parts.program.ops[self._backward_from :] if op.kind is not OpKind.LOSS]
        self._run(state, ops, pending.start_s)
        self._end_iteration(state.step, pending.start_s, state.sync)

    def _end_iteration(self, step: int, start: float, sync: bool) -> None:
        recorder = self.parts.recorder
        if self._last_step is None and sync:
            self._optimizer_step(step)  # a rank with no step op still joins the clipping collective
        self._pace()
        self._close_idle(step)
        self.parts.synchronize()
        recorder.settle()
        recorder.add(Span(step=step, label="iteration", category=Category.ITERATION, start_s=start, end_s=recorder.clock()))

    def forward(self, batch: Batch, position: int = 0) -> dict[str, Any]:
        """The forward ops alone (reshards and stage forwards, no loss, no backward): every layer output
        this rank computes for ``batch``, by layer name (evaluation; run it under ``torch.no_grad()``)."""
        state = _State(batch=batch, step=-1, position=position, sync=False)
        for op in self.parts.program.ops:
            if op.kind in (OpKind.RESHARD, OpKind.FORWARD):
                self._handlers[op.kind](op, state)
        return state.outputs

    def _run(self, state: _State, ops: Sequence[Op], start: float) -> None:
        """``ops`` in order (``start``: the iteration's start, for the idle windows they open)."""
        step, recorder = state.step, self.parts.recorder
        for op in ops:
            if op is self._last_step and state.last:
                self._optimizer_step(step)
            category = Category.COMM if op.kind in _COMM else Category.COMPUTE
            with recorder.span(step, op.label, category):
                self._handlers[op.kind](op, state)
            self._close_idle(step)
            for phase in op.phases:
                self._fire(phase, step, start)

    def _overlaps(self) -> dict[int, StageOverlap]:
        mine = [stage for stage in self.parts.program.stages if self.rank < stage.gpus and stage.gpus > 1]
        overlaps = {
            stage.index: StageOverlap(stage, self.parts.model.reduce_params, self._hand_over) for stage in mine
        }
        install_hooks(self.parts.model.params, list(overlaps.values()))
        return overlaps

    def _hand_over(self, layer: str, ranks: tuple[int, ...]) -> None:
        self._reduce_layer(layer, ranks)

    # -- idle windows ---------------------------------------------------------------------------
    def _pace(self) -> None:
        """Rank 0 marks its iteration's end to the wholly idle ranks (a send each); they wait for the mark."""
        group = self.parts.pace
        if group is None or self.rank not in group:
            return
        if self.rank == 0:
            self.parts.comm.exchange([(peer, torch.zeros(1, device=self.parts.device)) for peer in group[1:]], [])
        else:  # inside the open window: the mark is the window's measured end
            self.parts.comm.exchange([], [(0, torch.empty(1, device=self.parts.device))])

    def _fire(self, position: int | None, step: int, iteration_start: float) -> None:
        window = self.parts.idle.get(position)
        if window is None:
            return
        self._close_idle(step)
        event = IdleWindowEvent(rank=self.rank, step=step, window=window, opened_at_s=self.parts.recorder.clock(),
                                iteration_start_s=iteration_start)
        self._open_idle = event
        self.parts.on_idle.opened(event)

    def _close_idle(self, step: int) -> None:
        """An idle window lasts until the next op, which waits for the busy ranks, is done."""
        event = self._open_idle
        if event is None:
            return
        self._open_idle = None
        self.parts.synchronize()  # the window lasts until the device has done the op that waited for the busy ranks
        closed = self.parts.recorder.clock()
        self.parts.on_idle.closed(event, closed)
        window = event.window
        label = f"idle after {window.after or 'start'} (planned {window.length_ms:.3g} ms)"
        self.parts.recorder.add(Span(step=step, label=label, category=Category.IDLE, start_s=event.opened_at_s,
                                     end_s=closed))

    # -- ops ------------------------------------------------------------------------------------
    def _rows(self, layer: str) -> tuple[int, int]:
        return self.planned[layer].samples[self.rank]

    def _wire(self, producer: str, rows: int) -> torch.Tensor:
        """A buffer for ``rows`` of ``producer``'s output as it travels (:func:`to_wire`)."""
        layer = self.layers[producer]
        dtype = self.parts.precision.dtype(producer, getattr(torch, layer.dtype))
        shape = wire_shape((rows, *layer.output_shape), channels_last=layer.channels_last)
        return torch.empty(shape, dtype=dtype, device=self.parts.device)

    def _to_wire(self, producer: str, tensor: torch.Tensor) -> torch.Tensor:
        return to_wire(tensor, channels_last=self.layers[producer].channels_last)

    def _from_wire(self, producer: str, wire: torch.Tensor) -> torch.Tensor:
        return from_wire(wire, channels_last=self.layers[producer].channels_last)

    def _reshard(self, op: Op, state: _State) -> None:
        assert op.producer is not None
        out = state.outputs.get(op.producer)
        src_start = self._rows(op.producer)[0] if out is not None else 0
        sends = [(t.dst, self._to_wire(op.producer, out[t.start - src_start : t.end - src_start]))
                 for t in op.transfers if t.src == self.rank and t.dst != self.rank and out is not None]
        mine = [t for t in op.transfers if t.dst == self.rank]
        if not mine:
            self.parts.comm.exchange(sends, [])
            return
        dst_start, dst_end = self._rows(op.layer)
        whole = len(mine) == 1 and mine[0].src == self.rank and out is not None and len(out) == dst_end - dst_start
        if whole and out is not None:
            value, recvs = out.detach(), []
        else:
            wire = self._wire(op.producer, dst_end - dst_start)
            value = self._from_wire(op.producer, wire)
            recvs = [(t.src, wire[t.start - dst_start : t.end - dst_start]) for t in mine if t.src != self.rank]
            for t in mine:
                if t.src == self.rank and out is not None:
                    value[t.start - dst_start : t.end - dst_start] = out.detach()[t.start - src_start : t.end - src_start]
        self.parts.comm.exchange(sends, recvs)
        state.leaves[(op.stage, op.producer)] = value.requires_grad_(self.flows[op.producer])

    def _forward(self, op: Op, state: _State) -> None:
        stage = self.stages[op.stage]
        module = self.parts.model.stages[op.stage]
        start, end = self._rows(stage.layers[0])
        args = [
            state.batch.rows(self.placeholders[name], start, end).to(self.parts.device) if name in self.placeholders
            else state.leaves[(op.stage, name)]
            for name in module.inputs
        ]
        random = self.parts.model.random
        with self.parts.precision.autocast():
            if random is None:
                state.outputs.update(module(*args))
                return
            with random.at(step=state.draw, offset=start, ordinal=0):
                state.outputs.update(module(*args))

    def _loss(self, op: Op, state: _State) -> None:
        del op
        output = self.parts.model.graph.output
        start, end = self._rows(output)
        targets = state.batch.target_rows(start, end)
        local = None if targets is None else targets.to(self.parts.device)
        share = (end - start) / self.parts.plan.global_batch / state.micros
        with self.parts.precision.autocast():
            state.loss = self.parts.loss(state.outputs[output], local) * share

    def _backward(self, op: Op, state: _State) -> None:
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        loss = state.loss
        if loss is not None and self.parts.model.graph.output in self.stages[op.stage].layers and loss.requires_grad:
            tensors.append(self.parts.precision.scaled(loss))
            grads.append(None)
        for name in self.parts.model.stages[op.stage].outputs:
            output = state.outputs.pop(name)
            grad = state.grads.pop(name, None)
            if grad is not None and isinstance(output, torch.Tensor) and output.requires_grad:
                tensors.append(output)
                grads.append(grad)
        overlap = self.overlaps.get(op.stage)
        if overlap is not None and state.last:
            overlap.start()
        if tensors:
            torch.autograd.backward(tensors, grads)

    def _allreduce(self, op: Op, state: _State) -> None:
        """Hand the stage's gradients to the reducer, last layer first (the order of the backward);
        gradients of earlier micro-batches stay local and are summed into the last one's."""
        if not state.last:
            return
        overlap = self.overlaps.get(op.stage)
        if overlap is not None:
            overlap.finish()
            return
        stage = self.stages[op.stage]
        for name in reversed(stage.layers):
            self._reduce_layer(name, tuple(range(stage.gpus)))

    def _reduce_layer(self, layer: str, ranks: tuple[int, ...]) -> None:
        if len(ranks) == 1:
            return
        params = [self.parts.model.params[name] for name in self.parts.model.reduce_params[layer]]
        self.parts.reducer.add(ranks, [p.grad for p in params if p.grad is not None])

    def _reshard_grad(self, op: Op, state: _State) -> None:
        assert op.producer is not None
        leaf = state.leaves.pop((op.stage, op.producer), None)
        sends: list[tuple[int, torch.Tensor]] = []
        if leaf is not None:
            dst_start = self._rows(op.layer)[0]
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            for t in op.transfers:
                if t.dst == self.rank:
                    piece = grad[t.start - dst_start : t.end - dst_start]
                    if t.src == self.rank:
                        self._accumulate(state, op.producer, t, piece)
                    else:
                        sends.append((t.src, self._to_wire(op.producer, piece)))
        incoming = [t for t in op.transfers if t.src == self.rank and t.dst != self.rank]
        recvs = [(t.dst, self._wire(op.producer, t.end - t.start)) for t in incoming]
        self.parts.comm.exchange(sends, recvs)
        for t, (_, piece) in zip(incoming, recvs, strict=True):
            self._accumulate(state, op.producer, t, self._from_wire(op.producer, piece))

    def _accumulate(self, state: _State, producer: str, t: Transfer, piece: torch.Tensor) -> None:
        start, end = self._rows(producer)
        if producer not in state.grads:
            if (t.start, t.end) == (start, end):
                state.grads[producer] = piece
                return
            state.grads[producer] = torch.zeros((end - start, *piece.shape[1:]), dtype=piece.dtype, device=piece.device)
        state.grads[producer][t.start - start : t.end - start] += piece

    def _layer_step(self, op: Op, state: _State) -> None:
        """A stage's step phases; the optimizer itself steps once, before the rank's last one."""
        del op, state

    def _optimizer_step(self, step: int) -> None:
        recorder = self.parts.recorder
        with recorder.span(step, "allreduce:wait", Category.COMM):
            self.parts.reducer.finish()
        skip = self.parts.precision.unscale(self._grads())
        self._monitor(step)
        if self.parts.on_gradients is not None:
            self.parts.on_gradients(step)
        self._precondition(step, skip)
        with recorder.span(step, "optimizer", Category.COMPUTE):
            self._clip()
            if self.parts.lr_scaling is not None:
                lr = self.parts.lr_scaling.apply(self.parts.optimizer)
                scaler = self.parts.lr_scaling.scaler
                recorder.count(step, "adascale", {"gain": scaler.gain, "tau": scaler.tau, "lr": lr})
            if self.parts.optimizer is not None:
                if not skip:  # an fp16 overflow on some rank: every rank skips (deeppool.executor.engine.precision)
                    self.parts.optimizer.step()
                self.parts.optimizer.zero_grad(set_to_none=True)
            if self.parts.scheduler is not None:
                self.parts.scheduler.step()

    def _precondition(self, step: int, skip: bool) -> None:
        """K-FAC's step (factors, inverses, preconditioned gradients); a skipped step's statistics are dropped."""
        kfac = self.parts.preconditioner
        if kfac is None:
            return
        if skip:
            kfac.discard()
            return
        with self.parts.recorder.span(step, "kfac", Category.COMPUTE):
            kfac.step()

    def _monitor(self, step: int) -> None:
        """The noise scale's statistics of this step (collectives in every group), a trace counter on rank 0."""
        if self.parts.monitor is None:
            return
        with self.parts.recorder.span(step, "monitor:gns", Category.COMM):
            reading = self.parts.monitor.observe(step)
        if reading is not None:
            self.parts.recorder.count(step, "gns", {"noise_scale": reading.noise_scale, "grad_sq": reading.grad_sq_ema,
                                                    "trace": reading.trace_ema})

    def _grads(self) -> list[torch.Tensor]:
        """The gradients of the parameters this rank holds, tied ones once."""
        unique = {id(p): p for p in self.parts.model.params.values()}
        return [p.grad for p in unique.values() if p.grad is not None]

    def _clip(self) -> None:
        """Scale every gradient by ``min(1, clip_norm / (‖g‖ + 1e-6))``, ``‖g‖`` over the whole model."""
        limit = self.parts.clip_norm
        if limit is None:
            return
        unique = {id(p): p for p in self.parts.model.params.values()}
        grads = [p.grad for p in unique.values() if p.grad is not None]
        local = float(torch.nn.utils.get_total_norm(grads)) if self.rank == 0 and grads else 0.0
        total = self.parts.comm.all_reduce_max(local)
        if grads:
            torch.nn.utils.clip_grads_with_norm_(list(unique.values()), limit, torch.tensor(total))


def _channels_last_order(dims: int) -> tuple[int, ...]:
    """The dimension order whose contiguous tensor holds a channels-last tensor's bytes: (0, 2, 3, 1) in 4-d."""
    return (0, *range(2, dims), 1)


def wire_shape(shape: tuple[int, ...], *, channels_last: bool) -> tuple[int, ...]:
    """The shape of a reshard's buffer for a tensor of ``shape`` (:func:`to_wire`)."""
    return tuple(shape[d] for d in _channels_last_order(len(shape))) if channels_last else shape


def to_wire(tensor: torch.Tensor, *, channels_last: bool) -> torch.Tensor:
    """A reshard sends contiguous tensors (gloo takes no other). A channels-last output
    (:attr:`~deeppool.model.graph.Layer.channels_last`) travels with its channels last, so that the receiver's
    view of it (:func:`from_wire`) has the layout the model computes it in: some kernels run far slower on the
    other (``docs/executor.md``)."""
    if not channels_last:
        return tensor.contiguous()
    return tensor.permute(_channels_last_order(tensor.dim())).contiguous()


def from_wire(wire: torch.Tensor, *, channels_last: bool) -> torch.Tensor:
    """The received buffer as the output it carries: a view with channels-last strides for a channels-last one."""
    if not channels_last:
        return wire
    order = _channels_last_order(wire.dim())
    return wire.permute(tuple(order.index(d) for d in range(wire.dim())))
