"""Global batches: every rank sees the same global batch and takes its slices.

By default the batch is synthetic (the model file's ``inputs(B)`` and
``targets(B)``, the same every step). Through the Python API a user passes any
iterable of ``(inputs, targets)`` global batches, e.g. a ``DataLoader`` with
``batch_size=plan.global_batch``; ``inputs`` is a tensor, a tuple of
``forward``'s positional arguments or a dict of its keyword arguments. It must
yield the same batches on every rank (a seeded sampler, no per-rank sharding:
the executor slices). Inputs are held by ``forward``'s argument names.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from deeppool.errors import DeeppoolError
from deeppool.planner.modelspec import LoadedModel, bind_inputs


@dataclass(frozen=True)
class Batch:
    """One global batch: ``forward``'s arguments by name and the loss targets (dim 0 = samples)."""

    inputs: dict[str, Any]
    targets: torch.Tensor | None

    def run(self, model: Callable[..., Any]) -> Any:
        """The model's output on the whole batch (the single-process reference)."""
        return model(**self.inputs)


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
    """Batches from an iterable of ``(inputs, targets)``; ``inputs`` a tensor, tuple or dict."""

    def __init__(self, loader: Iterable[Any], global_batch: int, loaded: LoadedModel) -> None:
        self._loader = loader
        self._global_batch = global_batch
        self._module = loaded.module
        self._iterator: Iterator[Any] = iter(loader)

    def __call__(self, step: int) -> Batch:
        try:
            item = next(self._iterator)
        except StopIteration:
            self._iterator = iter(self._loader)
            item = next(self._iterator)
        return self._as_batch(item, step)

    def _as_batch(self, item: Any, step: int) -> Batch:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise DeeppoolError("the data loader must yield (inputs, targets) pairs")
        inputs, targets = item
        named = bind_inputs(self._module, inputs if isinstance(inputs, dict) else tuple(_listed(inputs)))
        return _checked(Batch(named, targets), self._global_batch, step)


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
