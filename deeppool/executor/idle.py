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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from deeppool.planner.plan import IdleWindow


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
