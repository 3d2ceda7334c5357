"""Global batches, and the rows of them that a rank loads.

By default the batch is synthetic (the model file's ``inputs(B)`` and
``targets(B)``, the same every step). Through the Python API a user passes any
iterable of ``(inputs, targets)`` global batches, e.g. a ``DataLoader`` with
``batch_size=plan.global_batch``; ``inputs`` is a tensor, a tuple of
``forward``'s positional arguments or a dict of its keyword arguments. It must
yield the same batches on every rank (a seeded sampler, no per-rank sharding:
the executor slices). Inputs are held by ``forward``'s argument names.

A map-style ``Dataset`` (``--data module:factory``, or ``data=`` a ``Dataset``)
is loaded per rank (:class:`DatasetBatches`): global batch ``n`` is the samples
``perm_e[b·B : (b+1)·B]`` with ``e = n // N``, ``b = n mod N``, ``N = ⌊len/B⌋``
batches per epoch (the incomplete last one is dropped, as ``drop_last=True``)
and ``perm_e = torch.randperm(len, generator=torch.Generator().manual_seed(seed + e))``;
row ``i`` of the global batch is sample ``perm_e[b·B + i]``. A rank loads only
the rows it computes on (:func:`needed_rows`): the union of its row ranges in
the layers that read the model's inputs and, for the loss, in the output layer.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import torch

from deeppool.errors import DeeppoolError
from deeppool.model.graph import LayerGraph
from deeppool.model.loading import LoadedModel, bind_inputs, importable_from
from deeppool.plans import Plan

Spans = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Batch:
    """One global batch: ``forward``'s arguments by name and the loss targets (dim 0 = samples).

    ``spans`` are the global rows held (sorted, disjoint, concatenated in that order) when the
    batch holds only some of them (:class:`DatasetBatches`); ``None``: all ``B`` rows.
    """

    inputs: dict[str, Any]
    targets: torch.Tensor | None
    spans: Spans | None = None

    def run(self, model: Callable[..., Any]) -> Any:
        """The model's output on the whole batch (the single-process reference)."""
        return model(**self.inputs)

    def rows(self, key: str, start: int, end: int) -> torch.Tensor:
        """Global rows ``[start, end)`` of input ``key``."""
        return self._slice(self.inputs[key], start, end)

    def target_rows(self, start: int, end: int) -> torch.Tensor | None:
        return None if self.targets is None else self._slice(self.targets, start, end)

    def _slice(self, tensor: torch.Tensor, start: int, end: int) -> torch.Tensor:
        if self.spans is None:
            return tensor[start:end]
        offset = 0
        for low, high in self.spans:
            if low <= start and end <= high:
                return tensor[offset + start - low : offset + end - low]
            offset += high - low
        raise ValueError(f"rows [{start}, {end}) of the global batch were not loaded (held: {list(self.spans)})")


class BatchSource(Protocol):
    def __call__(self, step: int) -> Batch: ...


class SyntheticBatches:
    """The model's own synthetic batch of ``global_batch`` samples, built once."""

    def __init__(self, loaded: LoadedModel, global_batch: int) -> None:
        self._batch = Batch(loaded.named_inputs(global_batch), loaded.targets(global_batch))

    def __call__(self, step: int) -> Batch:
        del step
        return self._batch


class LoaderBatches:
    """Batches from an iterable of ``(inputs, targets)``; ``inputs`` a tensor, tuple or dict.

    Batch ``n`` is the iterable's ``n``-th (starting over when it ends): asking for a later one skips ahead.
    """

    def __init__(self, loader: Iterable[Any], global_batch: int, loaded: LoadedModel) -> None:
        self._loader = loader
        self._global_batch = global_batch
        self._module = loaded.module
        self._iterator: Iterator[Any] = iter(loader)
        self._next = 0

    def __call__(self, step: int) -> Batch:
        while True:
            try:
                item = next(self._iterator)
            except StopIteration:
                self._iterator = iter(self._loader)
                item = next(self._iterator)
            self._next += 1
            if self._next > step:
                return _checked(_as_batch(item, self._module), self._global_batch, step)


def _as_batch(item: Any, module: torch.nn.Module, spans: Spans | None = None) -> Batch:
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise DeeppoolError("the data must give (inputs, targets) pairs")
    inputs, targets = item
    named = bind_inputs(module, inputs if isinstance(inputs, dict) else tuple(_listed(inputs)))
    return Batch(named, targets, spans)


@dataclass(frozen=True, kw_only=True)
class EpochOrder:
    """The seeded order of a dataset's samples: each epoch a permutation, cut into global batches."""

    length: int
    global_batch: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.length < self.global_batch:
            raise DeeppoolError(f"--data: the dataset has {self.length} samples, fewer than the plan's global batch "
                                f"of {self.global_batch}: use a larger dataset or re-plan with --batch {self.length}")

    @property
    def per_epoch(self) -> int:
        """Global batches per epoch, ``⌊length / B⌋`` (the incomplete last batch is dropped)."""
        return self.length // self.global_batch

    def position(self, index: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) of global batch ``index``."""
        return divmod(index, self.per_epoch)

    def permutation(self, epoch: int) -> torch.Tensor:
        """Epoch ``epoch``'s order of the samples."""
        return torch.randperm(self.length, generator=torch.Generator().manual_seed(self.seed + epoch))

    def samples(self, index: int, spans: Spans, permutation: torch.Tensor | None = None) -> list[int]:
        """The dataset indices of global batch ``index``'s rows in ``spans`` (``permutation``: its epoch's, if known)."""
        epoch, batch = self.position(index)
        order = self.permutation(epoch) if permutation is None else permutation
        first = batch * self.global_batch
        return [int(order[first + row]) for low, high in spans for row in range(low, high)]


@dataclass(frozen=True, kw_only=True)
class DataReport:
    """Where the data stands after a run: the summary's ``data``."""

    factory: str
    samples: int
    seed: int
    batches_per_epoch: int
    batches_trained: int
    """Global batches consumed since the start of training (a resumed run included)."""

    @property
    def epochs(self) -> float:
        return self.batches_trained / self.batches_per_epoch

    def to_json(self) -> dict[str, Any]:
        epoch, batch = divmod(self.batches_trained, self.batches_per_epoch)
        return {"factory": self.factory, "samples": self.samples, "seed": self.seed,
                "batches_per_epoch": self.batches_per_epoch, "batches_trained": self.batches_trained,
                "epochs": self.epochs, "next": {"epoch": epoch, "batch": batch}}


def load_dataset(factory: str) -> torch.utils.data.Dataset:
    """The map-style dataset ``factory`` (``package.module:callable`` or ``path/file.py:callable``) returns."""
    location, _, attr = factory.rpartition(":")
    module = _import_file(Path(location), factory) if location.endswith(".py") else _import_module(location, factory)
    make = getattr(module, attr, None)
    if not callable(make):
        raise DeeppoolError(f"--data '{factory}': '{location}' has no callable '{attr}'")
    dataset = make()
    if not isinstance(dataset, torch.utils.data.Dataset) or not hasattr(dataset, "__len__"):
        raise DeeppoolError(f"--data '{factory}' returned {type(dataset).__name__}, not a map-style "
                            "torch.utils.data.Dataset with __len__ and __getitem__")
    return dataset


def _import_module(name: str, factory: str) -> ModuleType:
    try:
        with importable_from(""):
            return importlib.import_module(name)
    except ImportError as err:
        raise DeeppoolError(f"--data '{factory}': cannot import '{name}': {err}") from None


def _import_file(path: Path, factory: str) -> ModuleType:
    if not path.is_file():
        raise DeeppoolError(f"--data '{factory}': no file '{path}'")
    spec = importlib.util.spec_from_file_location(f"deeppool_data_{abs(hash(str(path.resolve())))}", path)
    if spec is None or spec.loader is None:
        raise DeeppoolError(f"--data '{factory}': '{path}' cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Positions:
    """A DataLoader's batch sampler: the dataset indices of this rank's rows, global batch after batch."""

    def __init__(self, order: EpochOrder, spans: Spans, start: int) -> None:
        self._order, self._spans, self._start = order, spans, start

    def __iter__(self) -> Iterator[list[int]]:
        index, epoch, permutation = self._start, -1, None
        while True:
            if self._order.position(index)[0] != epoch:  # an epoch's order is drawn once, not per batch
                epoch = self._order.position(index)[0]
                permutation = self._order.permutation(epoch)
            yield self._order.samples(index, self._spans, permutation)
            index += 1


class DatasetBatches:
    """The rows ``spans`` of each global batch, loaded from a map-style dataset in :class:`EpochOrder`.

    Only the samples of those rows are read (``dataset[i]``, in a ``DataLoader`` with ``workers``
    processes, collated with ``default_collate``); ``spans=((0, B),)`` is the whole batch.
    """

    def __init__(self, dataset: torch.utils.data.Dataset, order: EpochOrder, spans: Spans, loaded: LoadedModel,
                 workers: int = 0) -> None:
        self.order = order
        self._dataset = dataset
        self._spans = spans
        self._held = None if spans == ((0, order.global_batch),) else spans
        self._module = loaded.module
        self._workers = workers
        self._iterator: Iterator[Any] | None = None
        self._next = -1

    def __call__(self, step: int) -> Batch:
        if not self._spans:
            return Batch({}, None, ())
        if self._iterator is None or step != self._next:
            loader = torch.utils.data.DataLoader(self._dataset, batch_sampler=_Positions(self.order, self._spans, step),
                                                 num_workers=self._workers)
            self._iterator = iter(loader)
        self._next = step + 1
        return _as_batch(next(self._iterator), self._module, self._held)


def needed_rows(plan: Plan, graph: LayerGraph, rank: int, *, targets: bool = True) -> Spans:
    """The global rows ``rank`` reads from the data: its rows of every layer it runs that reads a model
    input, and of the output layer (its loss's targets), merged into sorted disjoint spans."""
    inputs = set(graph.inputs)
    readers = {layer.name for layer in graph.layers if inputs.intersection(layer.inputs)}
    if targets:
        readers.add(graph.output)
    ranges = sorted(layer.samples[rank] for layer in plan.layers if layer.name in readers and rank < layer.gpus)
    return _merged(ranges)


def _merged(ranges: Sequence[tuple[int, int]]) -> Spans:
    merged: list[tuple[int, int]] = []
    for low, high in ranges:
        if high <= low:
            continue
        if merged and low <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    return tuple(merged)


def _listed(inputs: Any) -> list[Any]:
    return [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)


def _checked(batch: Batch, global_batch: int, step: int) -> Batch:
    tensors = [value for value in batch.inputs.values() if isinstance(value, torch.Tensor)]
    targets = batch.targets
    sizes = {len(t) for t in tensors} | ({len(targets)} if targets is not None else set())
    if sizes != {global_batch}:
        raise DeeppoolError(
            f"data loader batch {step} has {sorted(sizes)} samples, the plan's global batch is {global_batch}: "
            "use batch_size=plan.global_batch and drop_last=True"
        )
    return batch
