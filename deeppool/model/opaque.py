"""Opaque layers: a submodule no tracer can see inside runs eagerly, as one layer.

Code that only eager torch can run (a Python loop over a tensor's values, ``.item()``, ``.tolist()``,
``nonzero`` and ``topk`` routing whose shapes follow the data) cannot be a graph. When torch.fx stops
inside a submodule, or the graph's shape-only probe stops on a data-dependent shape inside one, the
tracer traces the model again with that submodule as an fx leaf: one ``call_module`` node, one layer,
which the executor runs eagerly on the rows its ranks hold, owning the submodule's parameters and
buffers. Its shapes and FLOPs come from a run on real tensors (FlopCounterMode counts what runs).

Splitting the batch is exact only when a sample's output does not depend on the batch's other samples
(routing per token is; a branch on ``x.sum()`` is not): :func:`check_rows` runs the submodule on the
probe batch, on each sample alone and with the other samples changed, and refuses it, naming it, when a
sample's output moves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

from deeppool.errors import DeeppoolError

_DATA_DEPENDENT = ("DynamicOutputShape", "DataDependent", "GuardOnDataDependent")
"""Exception class names a fake or meta run raises on a shape only real data decides."""
_RTOL, _ATOL = 1e-4, 1e-5


class ModuleFailure(DeeppoolError):
    """A tracer stopped: ``module`` is the submodule's path it stopped inside (None: the root's own code),
    ``reason`` the tracer's error in one line; ``retry_export`` False when torch.export would stop there too
    (fx traced the model; a shape only real data decides stopped its probe)."""

    def __init__(self, message: str, *, module: str | None, reason: str, retry_export: bool = True) -> None:
        super().__init__(message)
        self.module = module
        self.reason = reason
        self.retry_export = retry_export


def data_dependent(err: BaseException) -> bool:
    """Whether ``err`` is a shape-only run stopping on a shape or value only real data decides."""
    return any(name in type(err).__name__ for name in _DATA_DEPENDENT) or "data-dependent" in str(err)


def enclosing_module(node: fx.Node) -> str | None:
    """The innermost module ``node`` was traced inside (a leaf's own call: its parent); None for the root."""
    stack = [str(path) for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
    if node.op == "call_module" and stack and stack[-1] == str(node.target):
        stack.pop()
    return stack[-1] if stack and stack[-1] else None


def check_rows(path: str, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], batch: int,
               failed: Callable[[str], DeeppoolError]) -> None:
    """Refuse ``module`` (through ``failed``) when a sample's output depends on the batch's other samples.

    ``args``/``kwargs`` are the real inputs it got at the probe, whose tensors with ``batch`` rows in
    dimension 0 are the batched ones. Each sample is run alone, and in the batch with every other
    sample's floating-point values scaled by -3 (a branch on the batch's sum goes the other way); its
    output must be the batch's each time. Run under ``torch.no_grad`` with the RNG state restored after.
    """
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        whole = _rows(module(*args, **kwargs), batch)
        for row in range(batch):
            for rows, changed in ((1, _alone(batch, row)), (batch, _others_scaled(batch, row))):
                new_args, new_kwargs = pytree.tree_map(changed, (args, kwargs))
                got = _rows(module(*new_args, **new_kwargs), rows)
                at = row if rows == batch else 0
                if len(got) != len(whole) or not all(_close(w[row], g[at]) for w, g in zip(whole, got, strict=True)):
                    raise failed(
                        f"run eagerly as one layer, module '{path}' gives sample {row} another output when the "
                        "batch's other samples change (its code mixes samples, e.g. a branch on the batch's sum): "
                        "split across GPUs it would compute something else; make its output per sample"
                    )


def _alone(batch: int, row: int) -> Callable[[Any], Any]:
    def change(value: Any) -> Any:
        return value[row:row + 1] if _batched(value, batch) else value
    return change


def _others_scaled(batch: int, row: int) -> Callable[[Any], Any]:
    def change(value: Any) -> Any:
        if not _batched(value, batch) or not value.is_floating_point():
            return value
        scaled = value * -3.0
        scaled[row] = value[row]
        return scaled
    return change


def _batched(value: Any, batch: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch


def _rows(value: Any, batch: int) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(value) if _batched(leaf, batch)]


def _close(first: torch.Tensor, second: torch.Tensor) -> bool:
    if first.shape != second.shape or first.dtype != second.dtype:
        return False
    if not first.is_floating_point():
        return bool(torch.equal(first, second))
    return bool(torch.allclose(first, second, rtol=_RTOL, atol=_ATOL, equal_nan=True))
