"""Custom ``torch.autograd.Function``s: one node of the traced graph, so their own ``backward`` is what trains.

Tracing through ``MyFunction.apply`` records the ops of its ``forward`` and would differentiate
those: a straight-through estimator (``round`` forward, identity backward) would get ``round``'s
zero gradient. Under torch.fx every call of a user's Function whose arguments fx can record is
kept as one ``call_function`` node that calls ``apply`` (:func:`functions_as_nodes`). torch.export
always traces through, so a model that only export can trace is refused when it calls one
(:func:`functions_called`). torch's own Functions (activation checkpointing) recompute or reshape
what their forward does, and are traced through as before.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import fx
from torch.autograd.function import Function
from torch.utils import _pytree as pytree

from deeppool.errors import DeeppoolError


@dataclass(frozen=True)
class FunctionCall:
    """A call of a user's autograd Function: its class and where the model's code made it."""

    name: str
    where: str
    """`` at FILE:LINE (`source`)``, or '' when no frame of the model's code is on the stack."""


def _is_users(cls: type) -> bool:
    module = cls.__module__
    return module != "torch" and not module.startswith("torch.")


@functools.cache
def _applier(cls: type[Function]) -> Callable[..., Any]:
    """A plain function fx's generated code can name, which calls ``cls.apply``."""

    def apply(*args: Any, **kwargs: Any) -> Any:
        return cls.apply(*args, **kwargs)

    apply.__name__ = apply.__qualname__ = f"{cls.__name__}_apply"
    apply.__module__ = cls.__module__
    return apply


@contextlib.contextmanager
def _patched_apply(replacement: Callable[..., Any]) -> Iterator[None]:
    """``Function.apply`` replaced by ``replacement(cls, original, *args, **kwargs)`` for the block."""
    original = Function.__dict__["apply"]

    def apply(cls: type[Function], *args: Any, **kwargs: Any) -> Any:
        return replacement(cls, functools.partial(original.__func__, cls), *args, **kwargs)

    Function.apply = classmethod(apply)  # type: ignore[assignment,method-assign]
    try:
        yield
    finally:
        Function.apply = original  # type: ignore[method-assign]


@contextlib.contextmanager
def functions_as_nodes(tracer: fx.Tracer, where: Callable[[], str]) -> Iterator[None]:
    """While fx traces: a user's Function applied to traced values becomes one node calling its ``apply``."""

    def apply(cls: type[Function], original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        traced = any(isinstance(leaf, fx.Proxy) for leaf in pytree.tree_leaves((args, kwargs)))
        if not traced or not _is_users(cls):
            return original(*args, **kwargs)
        try:
            return tracer.create_proxy("call_function", _applier(cls), args, kwargs)
        except (NotImplementedError, TypeError) as err:
            raise DeeppoolError(
                f"the autograd Function '{cls.__name__}'{where()} takes an argument torch.fx cannot record "
                f"({err}); pass it tensors and constants only"
            ) from None

    with _patched_apply(apply):
        yield


@contextlib.contextmanager
def functions_called(where: Callable[[], str]) -> Iterator[list[FunctionCall]]:
    """The user's Functions called in the block (nothing else changes): torch.export traces through them."""
    calls: list[FunctionCall] = []

    def apply(cls: type[Function], original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if _is_users(cls):
            calls.append(FunctionCall(name=cls.__name__, where=where()))
        return original(*args, **kwargs)

    with _patched_apply(apply):
        yield calls


def refuse_traced_through(calls: list[FunctionCall]) -> None:
    """One line when torch.export traced through a user's Function: its ``backward`` would be lost."""
    if calls:
        call = calls[0]
        raise DeeppoolError(
            f"torch.export traces through the custom autograd Function '{call.name}'{call.where}: the plan would "
            "differentiate its forward's ops, not its backward; make the model traceable by torch.fx, which keeps "
            "the Function whole"
        )

