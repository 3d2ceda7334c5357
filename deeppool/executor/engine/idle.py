"""Idle windows: when, in each iteration, this rank has no foreground work.

The plan lists every rank's idle windows (``plan.predicted.idle_windows``):
stretches in which the layers being run use fewer GPUs than the rank's index.
The executor ties each window to the phase after which it begins and, when the
rank finishes that phase, calls the listener's :meth:`IdleListener.opened`
with an :class:`IdleWindowEvent` (a window with ``after=None`` opens at the
start of the iteration). The window lasts until the next op, which waits for
the busy ranks, is done; then :meth:`IdleListener.closed` gets the same event
and the instant it closed, so a listener knows each window's measured length.
Both calls are synchronous on the training thread: a listener must only hand
the window to background work (signal a process or a thread, enqueue a CUDA
graph) and return. See ``docs/executor.md``.

Who lends the windows is not the executor's business: the worker is handed a
:class:`StartLender` (the multiplexer's, wired by the command that starts the
ranks) and sees only the :class:`IdleLender` it returns.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from deeppool.plans import IdleWindow

if TYPE_CHECKING:
    import torch
    from rich.console import Console

    from deeppool.executor.engine.comm import Comm
    from deeppool.executor.engine.timing import Span
    from deeppool.plans import Plan


@dataclass(frozen=True, kw_only=True)
class IdleWindowEvent:
    """An idle window opening now: ``expected_ms`` is its predicted length."""

    rank: int
    step: int
    window: IdleWindow
    opened_at_s: float
    iteration_start_s: float

    @property
    def expected_ms(self) -> float:
        return self.window.length_ms


class IdleListener(Protocol):
    def opened(self, event: IdleWindowEvent) -> None: ...

    def closed(self, event: IdleWindowEvent, closed_at_s: float) -> None: ...


class NoBackground:
    """The default listener: no background work."""

    def opened(self, event: IdleWindowEvent) -> None:
        del event

    def closed(self, event: IdleWindowEvent, closed_at_s: float) -> None:
        del event, closed_at_s


class IdleLender(Protocol):
    """Background work lent one rank's idle windows for one run."""

    @property
    def listener(self) -> IdleListener: ...

    def foreground(self) -> AbstractContextManager[None]:
        """Where the foreground trains (a stream of its own, or nothing)."""
        ...

    def stop(self) -> object:
        """Stop the background (after training, also after a failure)."""
        ...

    def trace_spans(self) -> list[Span]:
        """The background's spans, for this rank's trace."""
        ...

    def gather(self, comm: Comm, spans: Iterable[Span]) -> dict[str, Any]:
        """On every rank, after :meth:`stop`: on rank 0 the sections it adds to ``summary.json`` (else empty)."""
        ...

    def show(self, console: Console) -> None:
        """On rank 0, after :meth:`gather`: print what it found."""
        ...


class StartLender(Protocol):
    def __call__(self, plan: Plan, *, rank: int, out_dir: Path | None, device: torch.device) -> IdleLender: ...
