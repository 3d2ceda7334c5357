"""``deeppool.parallelize(module, plan)``: a plan's burst parallelism inside the user's own training loop.

:func:`parallelize` does what ``deeppool run``'s ranks do before their first step (trace the model,
check it is the plan's, keep this rank's layers, compile its stages, make the process groups) and
wires the same :class:`~deeppool.executor.engine.engine.Engine`, with no optimizer: ``bp.step`` runs the
rank's program (forwards, reshards, backwards, gradient all-reduces, overlapped as in ``deeppool
run``) and leaves the summed gradients on :meth:`Parallelized.parameters`, for the user's optimizer,
scheduler, clipping and logging. The gradients are those of the *global* mean loss: ``loss_fn`` is a
mean over the samples it is given, and the engine weights each rank's by its share of the batch.

Every layer's group is ranks ``0..g-1``, so rank 0 holds every parameter and buffer: its
:meth:`Parallelized.state_dict` is the whole model's, in the original module's names; another rank's
is the part it holds (merging every rank's by key gives rank 0's, as a tensor held twice is equal).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from deeppool.adaptation.kfac import Collectives, KFACPreconditioner, Rate
from deeppool.adaptation.kfac_options import KfacOptions
from deeppool.device.cuda import gpu_for
from deeppool.device.seam import event_factory, side_stream, synchronizer
from deeppool.errors import DeeppoolError
from deeppool.executor.config import DEFAULT_TIMEOUT_S, BatchNormMode
from deeppool.executor.engine.comm import Lane, TorchComm
from deeppool.executor.engine.data import Batch, needed_rows
from deeppool.executor.engine.engine import Engine, EngineParts
from deeppool.executor.engine.gradients import FIRST_BUCKET_BYTES, GradientReducer
from deeppool.executor.engine.idle import NoBackground
from deeppool.executor.engine.kfac_groups import kfac_groups
from deeppool.executor.engine.local_model import LocalModel, check_plan_matches, hold
from deeppool.executor.engine.monitor import group_shares
from deeppool.executor.engine.program import Program, build_program, idle_positions, rank_groups
from deeppool.executor.engine.timing import Category, Recorder
from deeppool.executor.training.checkpoint import model_keys
from deeppool.library.amp import UserPrecision, non_finite, spread_overflow
from deeppool.library.world import LazyTotals, broadcast_module, join, world_sum
from deeppool.model.graph import TraceMethod
from deeppool.model.loading import LoadedModel, bind_inputs, default_loss, load_model
from deeppool.model.syncbn import GroupBatchNorm, Reduce
from deeppool.model.trace import Traced, trace
from deeppool.plans import ModelSource, Plan

LossFn = Callable[[Any, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class Options:
    """How :func:`parallelize` runs the plan (keyword arguments of :func:`parallelize`)."""

    bucket_mb: float = 25.0
    """Gradient all-reduce buckets (``--bucket-mb``); 0: one synchronous all-reduce per layer."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Collective timeout when :func:`parallelize` initialises ``torch.distributed`` itself."""
    batchnorm: BatchNormMode = BatchNormMode.SYNC

    def __post_init__(self) -> None:
        if self.bucket_mb < 0:
            raise DeeppoolError(f"bucket_mb={self.bucket_mb} is negative: give 0 (per layer) or a size in MiB")
        if self.timeout_s <= 0:
            raise DeeppoolError(f"timeout_s={self.timeout_s} must be positive")


def parallelize(
    module: nn.Module, plan: Plan | str | Path, *, example_inputs: Any = None, bucket_mb: float = 25.0,
    timeout_s: float = DEFAULT_TIMEOUT_S, batchnorm: BatchNormMode = BatchNormMode.SYNC,
) -> Parallelized:
    """This rank's part of ``plan`` for ``module`` (left unchanged: the rank trains a copy).

    Call it on every rank, after ``torchrun`` (or ``deeppool run --script``) started them; it
    initialises ``torch.distributed`` unless the script did. ``example_inputs`` (``forward``'s
    arguments for a few samples: a tensor, tuple or dict) are what the model is traced with; by
    default the plan's model makes them (its model file's ``inputs()``, or its input shape).
    """
    options = Options(bucket_mb=bucket_mb, timeout_s=timeout_s, batchnorm=batchnorm)
    loaded_plan = plan if isinstance(plan, Plan) else Plan.load(Path(plan))
    device = join(loaded_plan.gpus, options.timeout_s)
    return Parallelized(module, loaded_plan, _example_source(loaded_plan, example_inputs), device, options)


class Parallelized:
    """One rank's part of a plan, trained by the user's loop (made by :func:`parallelize`)."""

    def __init__(self, module: nn.Module, plan: Plan, inputs: Callable[[int], Any], device: torch.device,
                 options: Options) -> None:
        self.plan = plan
        self.device = device
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        comm = TorchComm(rank_groups(plan), timeout_s=options.timeout_s)
        self._comm = comm
        own, traced = _traced_copy(module, inputs, plan)
        self._keys = model_keys(own)
        """Each key of the module's ``state_dict``, and the name the traced model holds its tensor by."""
        self._signature_module = own  # binds inputs to ``forward``'s argument names
        traced_module = traced.module.to(device)
        with torch.random.fork_rng(devices=[]):  # a model file's inputs() may draw from the user's stream
            example = bind_inputs(own, inputs(2))
        self._precision = UserPrecision.measured(traced_module, traced.graph, example, device)
        every = {**dict(traced_module.named_parameters()), **dict(traced_module.named_buffers())}
        program = build_program(plan, traced.graph, self.rank)
        recorder = Recorder(time.perf_counter, event_factory(gpu_for(device)),
                            None if device.type == "cuda" else time.thread_time)
        self._local = hold(plan, traced_module, traced.graph, self.rank, lambda ranks: _group_sum(comm, ranks),
                           program.stages, traced.random, options.batchnorm)
        held = {**self._local.params, **self._local.buffers}
        self._unplaced = {key: every[name].detach() for key, name in self._keys.items()
                          if name not in held and name in every} if self.rank == 0 else {}
        """Rank 0's tensors no layer uses (a module the forward never calls), as they were: its state dict
        is the whole model's."""
        self._placeholder = None if self._local.params else nn.Parameter(torch.zeros(1, device=device))
        """A rank whose layers hold no parameter gets one zero (the model never reads it), so that the same
        optimizer and GradScaler code runs on every rank."""
        self._loss = _LossSlot()
        self._recorder = recorder
        self._engine = _engine(plan, program, self._local, comm, recorder, device, options, self._loss,
                               self._precision)
        self._calls = 0
        self._sync = True
        self._output_kind: str | None = None
        """The output's type when it is not one tensor ("" when it is; None until :meth:`forward` ran)."""
        self.training = True
        self.last_step_s: float | None = None
        """The wall-clock seconds of the last :meth:`step` (the engine's iteration span)."""
        self._losses = LazyTotals()
        atexit.register(self._losses.settle)

    # -- the training step ----------------------------------------------------------------------
    def step(self, inputs: Any, targets: torch.Tensor | None = None, loss_fn: LossFn | None = None, *,
             scaler: torch.amp.GradScaler | None = None) -> torch.Tensor:
        """Forward and backward of one global batch; returns the global mean loss (on every rank), a 0-dim
        tensor whose all-reduce finishes in the background and is waited for when the loss is first read
        (with ``scaler``, at once: every rank must agree on overflows before the optimizer steps).

        ``inputs`` are ``forward``'s arguments (a tensor, tuple or dict) for the plan's whole global
        batch, or only for the rows :meth:`rank_rows` names (``targets`` alike). ``loss_fn(output,
        targets)`` is a mean over samples (default: the model's own loss, else the mean square of its
        output). After it, this rank's parameters hold the gradient of the global mean loss, summed into
        what they held (call ``opt.zero_grad()`` as usual); under :meth:`no_sync` they hold this rank's
        unreduced part, and a later step outside it reduces the sum. With ``scaler`` (a
        ``torch.amp.GradScaler``) the backward starts from the scaled loss and every rank agrees on
        overflows (:mod:`deeppool.library.amp`): call ``scaler.step(opt)`` and ``scaler.update()`` as usual.
        """
        batch = self._batch(inputs, targets)
        self._loss.fn = loss_fn or default_loss
        self._precision.loss_scaler = scaler
        if scaler is not None:
            scaler.scale(torch.zeros((), device=self.device))  # initialised on ranks that compute no loss too
        try:
            share = self._engine.step(self._calls, [batch], self._calls, sync=self._sync)
        finally:
            self._precision.loss_scaler = None
        self._calls += 1
        if self._placeholder is not None and self._placeholder.grad is None:
            self._placeholder.grad = torch.zeros_like(self._placeholder)
        scaling = scaler is not None and scaler.is_enabled() and self._sync
        self._settle()
        if not scaling:
            return self._losses.total(share, self.device)
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        overflow = non_finite(grads)
        total, overflows = world_sum([share, 1.0 if overflow else 0.0], self.device)
        if overflows > 0 and not overflow:
            spread_overflow(grads)
        return torch.tensor(total, dtype=torch.float32)

    def forward(self, inputs: Any) -> torch.Tensor:
        """The model's output for a global batch (or this rank's rows of it), on every rank, as a tensor that
        autograd follows back into the plan: ``loss_fn(bp.forward(x), y).backward()`` runs the plan's backward
        and gradient all-reduces, leaving on this rank's parameters the gradient of that loss, as
        :meth:`step` does for the global mean loss. For loops that compute the loss themselves (a Lightning
        ``training_step``, :mod:`deeppool.integrations.lightning`); :meth:`step` saves the output's
        all-reduce and keeps the output where it was computed.

        Every rank must compute the same loss from the same output and targets (the same global batch on
        every rank). The output's rows are gathered in one all-reduce, and each rank takes its rows of the
        output's gradient. Without gradients (``torch.no_grad()``), this is :meth:`eval_step`. It runs in
        32-bit: under ``torch.autocast`` (whose backward would run outside it, with other reshard dtypes) and
        for a model whose output is not one tensor (a Hugging Face ``ModelOutput``), use :meth:`step`."""
        if not torch.is_grad_enabled():
            return self.eval_step(inputs)
        if torch.is_autocast_enabled(self.device.type):
            raise DeeppoolError("bp.forward runs in 32-bit: under torch.autocast, give bp.step a loss_fn (and "
                                "scaler=) instead")
        batch = self._batch(inputs, None)
        pending = self._engine.begin(self._calls, batch, self._calls, sync=self._sync)
        self._calls += 1
        rows = self._output_rows()
        mine = pending.output
        self._check_tensor_output(mine)
        whole = self._gathered(mine, rows)

        def finish(grad: torch.Tensor) -> None:
            self._engine.end(pending, None if mine is None else grad[rows[0] : rows[1]].to(mine.dtype).contiguous())
            if self._placeholder is not None and self._placeholder.grad is None:
                self._placeholder.grad = torch.zeros_like(self._placeholder)
            self._settle()

        return _PlanBackward.apply(torch.zeros((), requires_grad=True), whole, finish)

    def _check_tensor_output(self, mine: Any) -> None:
        """Refuse, on every rank alike, a model whose output is not one tensor: rank 0 (which computes rows of
        every layer) tells the others, once."""
        if self._output_kind is None:
            kind = [type(mine).__name__ if mine is not None and not isinstance(mine, torch.Tensor) else ""]
            if self.world_size > 1:
                dist.broadcast_object_list(kind, src=0)
            self._output_kind = kind[0]
        if self._output_kind:
            raise DeeppoolError(f"the model's output is a {self._output_kind}, not one tensor: bp.forward needs a "
                                "tensor output; give bp.step a loss_fn instead")

    def _output_rows(self) -> tuple[int, int]:
        """The global rows of the output this rank computes (``(0, 0)`` where none)."""
        name = self._local.graph.output
        samples = next(layer.samples for layer in self.plan.layers if layer.name == name)
        return samples[self.rank] if self.rank < len(samples) else (0, 0)

    def _gathered(self, mine: torch.Tensor | None, rows: tuple[int, int]) -> torch.Tensor:
        """Every rank's rows of the output, in row order, on every rank (an all-reduce of disjoint rows)."""
        layer = next(layer for layer in self._local.graph.layers if layer.name == self._local.graph.output)
        dtype = getattr(torch, layer.dtype) if mine is None else mine.dtype
        whole = torch.zeros((self.plan.global_batch, *layer.output_shape), dtype=dtype, device=self.device)
        if mine is not None:
            whole[rows[0] : rows[1]] = mine.detach()
        if self.world_size > 1:
            dist.all_reduce(whole)
        return whole

    def _settle(self) -> None:
        """Keep the last iteration's time; the engine's spans are not kept (a user loop has no end)."""
        spans = self._recorder.spans
        iteration = next((s for s in reversed(spans) if s.category is Category.ITERATION), None)
        self.last_step_s = None if iteration is None else iteration.end_s - iteration.start_s
        spans.clear()
        self._recorder.counters.clear()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Steps inside leave their gradients local and unreduced (gradient accumulation, as DDP's
        ``no_sync``); the first step after it reduces the accumulated sum."""
        before, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = before

    @torch.no_grad()
    def eval_step(self, inputs: Any) -> Any:
        """The model's output for a global batch (or this rank's rows of it), without gradients, on every
        rank: the output's per-sample tensors in row order; its other values (a scalar the model
        computed, e.g. a Hugging Face loss) as rank 0 computed them on its rows."""
        batch = self._batch(inputs, None)
        outputs = self._engine.forward(batch, self._calls)
        name = self._local.graph.output
        mine = None
        if name in outputs:
            start, end = next(layer.samples[self.rank] for layer in self.plan.layers if layer.name == name)
            mine = (end - start, pytree.tree_map(_to_cpu, outputs[name]))
        pieces: list[Any] = [None] * self.world_size
        dist.all_gather_object(pieces, mine)
        return pytree.tree_map(lambda t: _to(t, self.device), _joined([p for p in pieces if p is not None]))

    # -- what the user's optimizer, clipping and checkpoints see ---------------------------------
    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters this rank holds (each once): give them to the optimizer. A rank that holds none
        gives one placeholder zero, whose gradient is zero."""
        if self._placeholder is not None:
            yield self._placeholder
        seen: set[int] = set()
        for param in self._local.params.values():
            if id(param) not in seen:
                seen.add(id(param))
                yield param

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """The parameters this rank holds, by their names in the original module."""
        seen: set[int] = set()
        for key, name in self._keys.items():
            param = self._local.params.get(name)
            if param is not None and id(param) not in seen:
                seen.add(id(param))
                yield key, param

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The tensors this rank holds, under the original module's ``state_dict`` keys: on rank 0 the
        whole model's, which ``module.load_state_dict`` takes unchanged."""
        held = self.held_tensors()
        return {key: held[key].detach() if key in held else self._unplaced[key]
                for key in self._keys if key in held or key in self._unplaced}

    def held_tensors(self) -> dict[str, torch.Tensor]:
        """The live parameters and buffers this rank trains, under the original module's ``state_dict`` keys
        (a tied tensor under each of its keys): what an integration puts back in the user's module."""
        held = {**self._local.params, **self._local.buffers}
        return {key: held[name] for key, name in self._keys.items() if name in held}

    def load_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Copy ``state`` (a whole model's, e.g. rank 0's :meth:`state_dict` or the plain module's) into
        the tensors this rank holds; ``strict``: refuse a state that lacks one of them."""
        held = {**self._local.params, **self._local.buffers}
        missing = [key for key, name in self._keys.items() if name in held and key not in state]
        if strict and missing:
            raise DeeppoolError(f"the state dict lacks {len(missing)} tensors this rank holds, e.g. '{missing[0]}': "
                                "give the whole model's (rank 0's state_dict)")
        with torch.no_grad():
            for key, name in self._keys.items():
                if name in held and key in state:
                    held[name].copy_(state[key])

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip every rank's gradients by the norm over the whole model's (rank 0 holds every parameter
        and computes it; every rank receives it): ``torch.nn.utils.clip_grad_norm_`` over all ranks."""
        params = list(self.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        local = float(torch.nn.utils.get_total_norm(grads, norm_type)) if self.rank == 0 and grads else 0.0
        total = world_sum([local], self.device)[0]
        norm = torch.tensor(total)
        if grads:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def kfac(self, options: KfacOptions, *, lr: Rate, grad_scaler: Callable[[], float] | None = None
             ) -> KFACPreconditioner:
        """K-FAC over the ``Linear`` and ``Conv2d`` modules this rank runs, each over its layer's group (see
        :func:`deeppool.library.kfac.kfac`)."""
        groups = kfac_groups(self.plan, self._local.graph, self._local.module, self.rank)
        collectives: Collectives = self._comm
        return KFACPreconditioner(self._local.module, options, lr=lr, groups=groups, collectives=collectives,
                                  grad_scaler=grad_scaler)

    # -- modes and rows -------------------------------------------------------------------------
    def train(self, mode: bool = True) -> Parallelized:
        """Training mode (``mode``) or evaluation mode, as ``nn.Module.train``, synchronised BatchNorm included."""
        self.training = mode
        self._local.module.train(mode)
        for sub in self._local.module.modules():
            if isinstance(sub, GroupBatchNorm):  # it holds its BatchNorm outside the module tree
                sub.bn.train(mode)
        return self

    def eval(self) -> Parallelized:
        return self.train(False)

    @property
    def is_logging_rank(self) -> bool:
        """Rank 0: it holds every parameter; log, evaluate and save there."""
        return self.rank == 0

    def rank_rows(self, global_batch_size: int) -> list[int]:
        """The rows of a global batch this rank reads (its inputs' and its loss's), for a sampler that
        loads only those; ``step`` takes them in this order."""
        if global_batch_size != self.plan.global_batch:
            raise DeeppoolError(f"the plan's global batch is {self.plan.global_batch} samples, not "
                                f"{global_batch_size}: load batches of {self.plan.global_batch} (or re-plan)")
        return [row for low, high in self._spans() for row in range(low, high)]

    def _spans(self) -> tuple[tuple[int, int], ...]:
        return needed_rows(self.plan, self._local.graph, self.rank)

    def _batch(self, inputs: Any, targets: torch.Tensor | None) -> Batch:
        named = bind_inputs(self._signature_module, inputs if isinstance(inputs, Mapping) else _listed(inputs))
        rows = next((len(v) for v in named.values() if isinstance(v, torch.Tensor) and v.dim() > 0), None)
        whole, mine = self.plan.global_batch, sum(high - low for low, high in self._spans())
        if rows == whole:
            return Batch(named, targets)
        if rows == mine:
            return Batch(named, targets, self._spans())
        raise DeeppoolError(f"the batch has {rows} rows: give the plan's global batch of {whole} "
                            f"(a DataLoader with drop_last=True) or this rank's {mine} rows (bp.rank_rows)")


class _PlanBackward(torch.autograd.Function):
    """The gathered output as a node of the caller's graph: its backward runs the engine's backward half.

    ``anchor`` (a fresh leaf) makes the output require gradients; the plan's parameters get theirs from the
    engine, not through this node."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, whole: torch.Tensor,
                finish: Callable[[torch.Tensor], None]) -> torch.Tensor:
        del anchor
        ctx.finish = finish
        return whole

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.finish(grad)
        return None, None, None


class _LossSlot:
    """The engine's loss function: the one the current ``step`` was given."""

    fn: LossFn = staticmethod(default_loss)

    def __call__(self, output: Any, targets: torch.Tensor | None) -> torch.Tensor:
        return self.fn(output, targets)


def _traced_copy(module: nn.Module, inputs: Callable[[int], Any], plan: Plan) -> tuple[nn.Module, Traced]:
    """A copy of ``module`` with rank 0's tensors, traced (in training mode, no gradients) and checked
    against the plan."""
    own = copy.deepcopy(module).cpu()
    broadcast_module(own)
    loaded = LoadedModel(module=own, inputs=inputs, targets=lambda rows: None, loss=default_loss)
    with torch.random.fork_rng(devices=[]):  # tracing runs the model: the script's random stream stays as it was
        traced = trace(loaded)
    check_plan_matches(plan, traced.graph)
    if traced.graph.method is TraceMethod.FX:
        traced.module.train()
    traced.module.zero_grad(set_to_none=True)  # tracing measures backward FLOPs and leaves gradients
    return own, traced


def _engine(plan: Plan, program: Program, local: LocalModel, comm: TorchComm, recorder: Recorder,
            device: torch.device, options: Options, loss: _LossSlot, precision: UserPrecision) -> Engine:
    """The executor's engine as ``deeppool run`` wires it, without an optimizer, scheduler or monitor."""
    shares = group_shares(plan, local.graph, comm.rank)
    bucket = int(options.bucket_mb * 2**20)
    gpu = gpu_for(device)
    reducer = GradientReducer(comm, bucket, side_stream(gpu, device),
                              first_bucket_bytes=FIRST_BUCKET_BYTES if gpu is not None else None,
                              combine=plan.combine, scales={share.ranks: share.scale for share in shares})
    synchronize = synchronizer(gpu, device)
    return Engine(EngineParts(
        plan=plan, program=program, model=local, comm=comm, loss=loss, optimizer=None, reducer=reducer,
        recorder=recorder, idle=idle_positions(program, plan.idle_windows(comm.rank)), on_idle=NoBackground(),
        device=device, overlap=bucket > 0, synchronize=synchronize, precision=precision,
    ))


def _group_sum(comm: TorchComm, ranks: tuple[int, ...]) -> Reduce:
    """Synchronised BatchNorm's sum over ``ranks``, on its own lane."""
    return lambda tensor: comm.all_reduce(tensor, ranks, lane=Lane.STATISTICS)


def _example_source(plan: Plan, example: Any) -> Callable[[int], Any]:
    """``inputs(batch_size)`` for tracing: rows of ``example`` repeated, or the plan's model's inputs."""
    if example is not None:
        return lambda rows: _resized(example, rows)
    if plan.model.source is ModelSource.PYTHON:
        raise DeeppoolError("the plan was made from a module in Python: give parallelize(..., example_inputs=...) "
                            "(forward's arguments for a few samples)")
    with torch.random.fork_rng(devices=[]):
        return load_model(plan.model, meta=True).inputs


def _resized(example: Any, rows: int) -> Any:
    """``example`` with ``rows`` samples (its rows repeated in order): tensors with a batch dimension."""
    def resize(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        return value[torch.arange(rows) % len(value)]

    if isinstance(example, torch.Tensor):
        return (resize(example),)
    if isinstance(example, Mapping):
        return {key: resize(value) for key, value in example.items()}
    return tuple(resize(value) for value in example)


def _listed(inputs: Any) -> tuple[Any, ...]:
    return (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)


def _joined(pieces: list[tuple[int, Any]]) -> Any:
    """The output layer's pieces (rows, output) in rank order as one output: per-sample tensors concatenated."""
    leaves, spec = zip(*(pytree.tree_flatten(output) for _, output in pieces), strict=True)
    joined = []
    for index, first in enumerate(leaves[0]):
        per_sample = isinstance(first, torch.Tensor) and all(
            isinstance(ls[index], torch.Tensor) and ls[index].dim() > 0 and len(ls[index]) == rows
            for ls, (rows, _) in zip(leaves, pieces, strict=True))
        joined.append(torch.cat([ls[index] for ls in leaves]) if per_sample else first)
    return pytree.tree_unflatten(joined, spec[0])


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def _to(value: Any, device: torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value

