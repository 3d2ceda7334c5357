"""One hosting rank's multiplexing: the idle listener the executor calls, over a background.

The executor calls it when each idle window opens and closes (synchronous on
the training thread, so it only does arithmetic, one pipe write and a signal).
When a window opens it

1. closes the previous iteration's timing when a new step begins (its length is
   the gap between the iterations' starts) and feeds it to the A/B baseline
   (alone steps) or to the :class:`SlowdownController` (shared steps);
2. in a gated mode, admits background work into the window. The budget is the
   window's *measured* length (the median of the same window in the alone
   steps; before any is measured, its planned length rescaled by the
   undisturbed over the predicted iteration time) times the controller's
   share, and ``opened + budget`` is the deadline. Windows expected shorter
   than ``min_window_ms`` are not lent. In a free mode it switches the
   background on or off at the A/B block boundaries.

When a gated window closes, the background is told at once (the CPU child is
stopped, the GPU thread launches no further piece), so no background work
runs outside a window, and the window's measured length is recorded beside
the work done in it (the efficiency by window length).
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from typing import Protocol

from deeppool.executor.engine.idle import IdleWindowEvent
from deeppool.multiplex.config import BackgroundConfig
from deeppool.multiplex.controller import ControllerConfig, SlowdownController, relative_noise
from deeppool.multiplex.metrics import RankBackground

BASELINE_KEEP = 16
READY_TIMEOUT_S = 60.0


class Background(Protocol):
    """Where the background work runs (a process, a thread on a low-priority stream)."""

    def admit(self, deadline_s: float, window_ms: float, *, overrun: bool = False) -> None:
        """Work in the window until ``deadline_s``; ``overrun``: no foreground op follows the window on this
        device (the rank runs no layer), so the last piece may end after the deadline."""
        ...

    def close(self, window_ms: float | None) -> None: ...

    def running(self, on: bool) -> None: ...

    def wait_ready(self, timeout_s: float) -> None: ...

    def stop(self, timeout_s: float = 10.0) -> RankBackground: ...


class Session:
    """The :class:`~deeppool.executor.engine.idle.IdleListener` of one hosting rank."""

    def __init__(self, config: BackgroundConfig, background: Background, *, predicted_iteration_ms: float,
                 idle_throughout: bool = False) -> None:
        self.config = config
        self.idle_throughout = idle_throughout
        """The rank runs no layer: its window runs into the next iteration's, so a piece may cross."""
        self.background = background
        self.predicted_ms = predicted_iteration_ms
        self.controller = SlowdownController(ControllerConfig(target=config.slowdown_target))
        self.alone_ms: list[float] = []
        self.window_ms: dict[str | None, list[float]] = {}
        self._step: int | None = None
        self._step_start = 0.0
        self._on = False
        self._admitted = False

    def opened(self, event: IdleWindowEvent) -> None:
        if event.step != self._step:
            self._new_step(event)
        expected = self.expected_ms(event)
        if self._on and self.config.mode.gated and expected >= self.config.min_window_ms:
            self.background.admit(event.opened_at_s + self.controller.share * expected / 1e3, expected,
                                  overrun=self.idle_throughout)
            self._admitted = True

    def closed(self, event: IdleWindowEvent, closed_at_s: float) -> None:
        length_ms = 1e3 * (closed_at_s - event.opened_at_s)
        if self._admitted:  # a transition step's window (it waited for the background to load) is not a sample
            self.background.close(length_ms if self.config.schedule.measured(event.step) else None)
            self._admitted = False
        elif not self.config.schedule.shared(event.step) and event.step >= 1:
            known = self.window_ms.setdefault(event.window.after, [])
            self.window_ms[event.window.after] = (known + [length_ms])[-BASELINE_KEEP:]

    def expected_ms(self, event: IdleWindowEvent) -> float:
        """The window's undisturbed length here: measured in the alone steps, else planned and rescaled."""
        measured = self.window_ms.get(event.window.after)
        return statistics.median(measured) if measured else event.expected_ms * self.scale

    @property
    def scale(self) -> float:
        """Measured undisturbed ms per planned ms (1 before a baseline exists)."""
        if not self.alone_ms or self.predicted_ms <= 0:
            return 1.0
        return statistics.median(self.alone_ms) / self.predicted_ms

    def _new_step(self, event: IdleWindowEvent) -> None:
        schedule = self.config.schedule
        if self._step is not None and event.step == self._step + 1:
            elapsed_ms = 1e3 * (event.iteration_start_s - self._step_start)
            if not schedule.shared(self._step) and self._step >= 1:  # step 0 warms up
                self.alone_ms = (self.alone_ms + [elapsed_ms])[-BASELINE_KEEP:]
            elif schedule.measured(self._step) and self.alone_ms:
                self.controller.observe(elapsed_ms, statistics.median(self.alone_ms), relative_noise(self.alone_ms))
        self._step, self._step_start = event.step, event.iteration_start_s
        on = schedule.shared(event.step)
        if on and not self._on:  # a transition step, never measured: the background must be up to share
            self.background.wait_ready(READY_TIMEOUT_S)
        if on != self._on and not self.config.mode.gated:
            self.background.running(on)
        self._on = on

    def stop(self) -> RankBackground:
        result = self.background.stop()
        if not self.config.mode.gated:
            return result
        return replace(result, share=self.controller.share, backoffs=self.controller.backoffs)
