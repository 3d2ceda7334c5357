"""Per-sample randomness: random ops draw the same values however the batch is split.

The executor runs each layer on rows ``[offset, offset + n)`` of the global
batch, on whichever ranks the Plan gives it. A random op (dropout, ``rand_like``,
``bernoulli_``, ...) that drew from the process's RNG would give different
samples the same mask on different ranks, and the result would depend on the
split. :class:`SampleRandomness` is a ``TorchDispatchMode`` that makes every
random op draw *per sample* instead.

Which ops are random: every ``OpOverload`` tagged
``torch.Tag.nondeterministic_seeded``. Every other op runs untouched; the tag
check (memoised per op, one dict lookup) is the first thing the mode does.

Each random call has an *ordinal* ``k``: its position among the random calls of
one forward, in the model's execution order (the caller sets it before running
a graph node, because a rank runs only some nodes). The trace decides per
ordinal whether the call is *batched* (its output follows the batch in dim 0).

Seed formula, with ``mix(a, b, c, d) = blake2b(pack("<4q", a, b, c, d), 8 bytes)
as a little-endian integer >> 1`` (63 bits, the same in every process and run)::

    batched call k, local row j:  seed_kj = mix(seed, step, k, offset + j)
    shared call k:                seed_k  = mix(seed, step, k, -1)

A batched call runs once per local row ``j`` on that sample alone (tensor
arguments whose dim 0 is ``n`` are sliced ``[j:j+1]``, a size list starting
with ``n`` starts with 1 instead) with the device's default generator seeded to
``seed_kj``, and its outputs are concatenated along dim 0; an op that writes an
argument (``bernoulli_``, ``out=``) writes through the slice and returns that
argument. A shared call runs once with the generator seeded to ``seed_k``, so
every rank draws the same values. An explicit ``generator=`` argument is
replaced by the seeded default generator. The caller's generator state is saved
before the call and restored after it, so the user's own RNG stream is untouched.
Limits: the batch must be dim 0 of a batched call (an RNN with
``batch_first=False`` and inter-layer dropout is not split per sample), and a
tensor argument whose dim 0 equals ``n`` by coincidence is sliced too.

Hence sample ``i`` at step ``s`` in call ``k`` always draws from ``mix(seed, s,
k, i)``: a single process running the whole batch at offset 0 draws exactly
what the ranks draw together. The mode sits below autograd, so backward
formulas see the per-sample masks like any other saved tensor.

With ``batched=None`` the mode only *records* (at trace time): each random call
appends a :class:`RandomCall` with its op and the size of dim 0 of its first
tensor output, and draws are unchanged. :func:`batched_calls` compares
recordings at two probe batch sizes to decide ``batched``.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._ops import OpOverload
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from deeppool.device.cuda import gpu_for
from deeppool.errors import DeeppoolError

_SEEDED = torch.Tag.nondeterministic_seeded
_SHARED_ROW = -1


@dataclass(frozen=True)
class RandomCall:
    """One random op call seen while recording: ``rows`` is dim 0 of its first tensor output."""

    ordinal: int
    op: str
    rows: int | None


def sample_seed(seed: int, step: int, ordinal: int, row: int) -> int:
    """``mix(seed, step, ordinal, row)``: blake2b of the four packed int64s, 63 bits."""
    digest = hashlib.blake2b(struct.pack("<4q", seed, step, ordinal, row), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def batched_calls(probes: Mapping[int, Sequence[RandomCall]]) -> dict[int, bool]:
    """Per ordinal, whether its rows equal the probe's batch size in every probe.

    ``probes`` maps a batch size to the calls recorded when running a batch of
    that size; they must record the same ops in the same order.
    """
    recordings = list(probes.values())
    if not recordings:
        return {}
    ops = [call.op for call in recordings[0]]
    for size, calls in probes.items():
        if [call.op for call in calls] != ops:
            raise DeeppoolError(
                f"random ops differ between probe batch sizes (batch {size}); "
                "the model's random calls must not depend on the batch size"
            )
    return {
        call.ordinal: all(calls[index].rows == size for size, calls in probes.items())
        for index, call in enumerate(recordings[0])
    }


class SampleRandomness(TorchDispatchMode):
    """Makes every random op draw per sample of the global batch (see module docstring).

    ``step``, ``offset`` (global index of local row 0) and ``ordinal`` (of the
    next random call, advanced by one per call) are set by the caller with
    :meth:`at`. ``calls`` holds the records of a recording mode.
    """

    _generators = threading.RLock()
    """Held from seeding the default generator to the draw: the generator is one per process and device, so
    ranks run as threads of one process (the tests' thread world) would otherwise draw with each other's seeds."""

    def __init__(self, *, seed: int, batched: Mapping[int, bool] | None = None) -> None:
        super().__init__()
        if not 0 <= seed < 2**63:
            raise DeeppoolError(f"randomness seed {seed} must be in [0, 2**63)")
        self.seed = seed
        self.batched = None if batched is None else dict(batched)
        self.step = 0
        self.offset = 0
        self.ordinal = 0
        self.calls: list[RandomCall] = []
        self._seeded: dict[OpOverload, bool] = {}

    def at(self, *, step: int, offset: int, ordinal: int) -> SampleRandomness:
        """Set the position and return the mode, so ``with mode.at(...):`` also enters it."""
        if min(step, offset, ordinal) < 0:
            raise DeeppoolError(f"randomness position {step=} {offset=} {ordinal=} must be non-negative")
        self.step, self.offset, self.ordinal = step, offset, ordinal
        return self

    def __torch_dispatch__(
        self, func: OpOverload, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        seeded = self._seeded.get(func)
        if seeded is None:
            seeded = self._seeded[func] = _SEEDED in func.tags
        if not seeded:
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        ordinal = self.ordinal
        self.ordinal += 1
        if self.batched is None:
            return self._record(func, args, kwargs, ordinal)
        if ordinal not in self.batched:
            raise DeeppoolError(
                f"random op {func} at ordinal {ordinal} was not seen when the model was traced; "
                "the model's random calls must not depend on the data"
            )
        if "generator" in kwargs:
            kwargs = {**kwargs, "generator": None}
        generator = _default_generator(_device_of(args, kwargs))
        with self._generators:
            state = generator.get_state()
            try:
                if self.batched[ordinal]:
                    return self._per_sample(func, args, kwargs, ordinal, generator)
                generator.manual_seed(sample_seed(self.seed, self.step, ordinal, _SHARED_ROW))
                return func(*args, **kwargs)
            finally:
                generator.set_state(state)

    def _record(self, func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], ordinal: int) -> Any:
        output = func(*args, **kwargs)
        first = next(_tensors(output), None)
        rows = first.shape[0] if first is not None and first.dim() > 0 else None
        self.calls.append(RandomCall(ordinal=ordinal, op=str(func), rows=rows))
        return output

    def _per_sample(
        self, func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], ordinal: int, generator: torch.Generator
    ) -> Any:
        rows = _local_rows(func, args)
        if rows == 0:
            return func(*args, **kwargs)
        outputs = []
        for j in range(rows):
            generator.manual_seed(sample_seed(self.seed, self.step, ordinal, self.offset + j))
            sample_args = tuple(_one_sample(value, rows, j) for value in args)
            sample_kwargs = {name: _one_sample(value, rows, j) for name, value in kwargs.items()}
            outputs.append(func(*sample_args, **sample_kwargs))
        return _join(func, outputs, args, kwargs)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors among the leaves of a (nested) value, in order."""
    return (leaf for leaf in tree_flatten(value)[0] if isinstance(leaf, torch.Tensor))


def _is_size(value: Any) -> bool:
    return isinstance(value, list | tuple) and len(value) > 0 and all(isinstance(item, int) for item in value)


def _local_rows(func: OpOverload, args: tuple[Any, ...]) -> int:
    """``n``: dim 0 of the first tensor argument, else the first element of a size list."""
    for tensor in _tensors(args):
        if tensor.dim() > 0:
            return int(tensor.shape[0])
    for value in args:
        if _is_size(value):
            return int(value[0])
    raise DeeppoolError(f"random op {func} has no tensor or size argument to split per sample")


def _one_sample(value: Any, rows: int, j: int) -> Any:
    """Sample ``j`` of an argument: batch tensors sliced to ``[j:j+1]``, a batch size list to 1."""
    if isinstance(value, torch.Tensor):
        return _row(value, rows, j)
    if _is_size(value):
        return [1, *value[1:]] if value[0] == rows else value
    if isinstance(value, list | tuple | dict):
        return tree_map(lambda leaf: _row(leaf, rows, j), value)
    return value


def _row(leaf: Any, rows: int, j: int) -> Any:
    batch = isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == rows
    return leaf[j : j + 1] if batch else leaf


def _argument(func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], index: int) -> Any:
    return args[index] if index < len(args) else kwargs[func._schema.arguments[index].name]


def _written_sources(func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """Per return of ``func``: the argument it writes and returns, or None."""
    arguments = func._schema.arguments
    written = {
        frozenset(arg.alias_info.before_set): index
        for index, arg in enumerate(arguments)
        if arg.alias_info is not None and arg.alias_info.is_write
    }
    sources = []
    for ret in func._schema.returns:
        index = written.get(frozenset(ret.alias_info.before_set)) if ret.alias_info is not None else None
        sources.append(None if index is None else _argument(func, args, kwargs, index))
    return sources


def _concat(*parts: Any) -> Any:
    """The per-sample outputs joined leaf by leaf: tensors on dim 0, anything else from sample 0."""

    def join(*leaves: Any) -> Any:
        return torch.cat(leaves) if isinstance(leaves[0], torch.Tensor) else leaves[0]

    return tree_map(join, parts[0], *parts[1:])


def _join(func: OpOverload, outputs: list[Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The whole-batch output: written arguments as they are, other outputs concatenated on dim 0.

    A concatenated output shaped like the op's first tensor argument takes that argument's
    strides, as the op's own output does (``dropout`` of a transposed tensor is transposed):
    the model's next ``view`` may rely on them.
    """
    sources = _written_sources(func, args, kwargs)
    expected = _expected_outputs(func, args, kwargs, len(sources))
    if len(sources) == 1:
        return sources[0] if sources[0] is not None else _laid_out(_concat(*outputs), expected[0])
    columns = zip(*outputs, strict=True)
    return tuple(
        source if source is not None else _laid_out(_concat(*column), like)
        for source, column, like in zip(sources, columns, expected, strict=True)
    )


def _expected_outputs(func: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any], count: int) -> list[Any]:
    """The op's own outputs on the whole batch as meta tensors (their strides are the eager op's), one per
    return; without a meta kernel, the first tensor argument, the layout that ops like ``dropout`` keep.

    The model's next ``view`` may rely on the op's layout: ``randn_like(x, memory_format=contiguous_format)``
    of a transposed ``x`` is contiguous, flash attention's logsumexp is not."""
    like = next(_tensors((args, kwargs)), None)
    if like is None:  # drawn from a size alone (``torch.rand(shape)``): contiguous, as joined
        return [None] * count
    try:
        result = func(*tree_map(_meta, args), **tree_map(_meta, kwargs))
    except Exception:  # noqa: BLE001  no meta kernel for this op: keep the argument's layout
        return [like] * count
    return list(result) if count > 1 else [result]


def _meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) else value


def _laid_out(joined: Any, like: Any) -> Any:
    """``joined`` in the memory layout of ``like`` when it has its shape, else as it is."""
    if not isinstance(joined, torch.Tensor) or not isinstance(like, torch.Tensor) or joined.shape != like.shape:
        return joined
    if joined.stride() == like.stride():
        return joined
    return torch.empty_strided(joined.shape, like.stride(), dtype=joined.dtype, device=joined.device).copy_(joined)


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    first = next(_tensors((args, kwargs)), None)
    if first is not None:
        return first.device
    device = kwargs.get("device")
    return torch.device(device) if device is not None else torch.get_default_device()


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    gpu = gpu_for(device)
    if gpu is not None:
        return gpu.generator(device)
    raise DeeppoolError(f"per-sample randomness supports cpu and cuda tensors, not '{device.type}'")


@dataclass(frozen=True, kw_only=True)
class RandomSites:
    """Where a traced model draws random numbers: each node's first ordinal, and which calls are batched."""

    first: Mapping[str, int]
    batched: Mapping[int, bool]

    def __bool__(self) -> bool:
        return bool(self.batched)

    def mode(self, seed: int) -> SampleRandomness:
        """A mode that draws per sample for this model."""
        return SampleRandomness(seed=seed, batched=self.batched)
