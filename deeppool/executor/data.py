"""Global batches: every rank sees the same global batch and takes its slices.

By default the batch is synthetic (the model file's ``inputs(B)`` and
``targets(B)``, the same every step). Through the Python API a user passes any
iterable of ``(inputs, targets)`` global batches, e.g. a ``DataLoader`` with
``batch_size=plan.global_batch``; it must yield the same batches on every rank
(a seeded sampler, no per-rank sharding: the executor slices).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from deeppool.errors import DeeppoolError
from deeppool.planner.modelspec import LoadedModel


@dataclass(frozen=True)
class Batch:
    """One global batch: the model inputs and the loss targets (dim 0 = samples)."""

    inputs: tuple[torch.Tensor, ...]
    targets: torch.Tensor | None


class BatchSource(Protocol):
    def __call__(self, step: int) -> Batch: ...


class SyntheticBatches:
    """The model's own synthetic batch of ``global_batch`` samples, built once."""

    def __init__(self, loaded: LoadedModel, global_batch: int) -> None:
        self._batch = Batch(tuple(loaded.inputs(global_batch)), loaded.targets(global_batch))

    def __call__(self, step: int) -> Batch:
        del step
        return self._batch


class LoaderBatches:
    """Batches from an iterable of ``(inputs, targets)``; ``inputs`` a tensor or tuple."""

    def __init__(self, loader: Iterable[Any], global_batch: int) -> None:
        self._loader = loader
        self._global_batch = global_batch
        self._iterator: Iterator[Any] = iter(loader)

    def __call__(self, step: int) -> Batch:
        try:
            item = next(self._iterator)
        except StopIteration:
            self._iterator = iter(self._loader)
            item = next(self._iterator)
        return _as_batch(item, self._global_batch, step)


def _as_batch(item: Any, global_batch: int, step: int) -> Batch:
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise DeeppoolError("the data loader must yield (inputs, targets) pairs")
    inputs, targets = item
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    sizes = {len(t) for t in inputs} | ({len(targets)} if targets is not None else set())
    if sizes != {global_batch}:
        raise DeeppoolError(
            f"data loader batch {step} has {sorted(sizes)} samples, the plan's global batch is {global_batch}: "
            "use batch_size=plan.global_batch and drop_last=True"
        )
    return Batch(inputs, targets)
