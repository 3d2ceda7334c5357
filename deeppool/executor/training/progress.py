"""Rank 0's progress file, ``<out>/progress.json``: the optimizer steps done and asked for.

Written atomically (:func:`~deeppool.plans.jsonio.write_json`) at most once every ``every_s``
seconds and after the last step, so a job's supervisor (the coordinator) can show a running
run's progress without talking to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from deeppool.executor.training.outputs import PROGRESS
from deeppool.plans.jsonio import write_json


@dataclass(kw_only=True)
class ProgressFile:
    out_dir: Path
    steps: int
    every_s: float = 1.0
    clock: Callable[[], float] = time.monotonic
    _written_at: float = field(default=float("-inf"), init=False)
    _first: tuple[int, float] | None = field(default=None, init=False)

    def update(self, steps_done: int) -> None:
        """``first_step``: the first step this process took and when it ended (wall time, for a resumed run's
        restart cost)."""
        self._first = self._first or (steps_done, time.time())
        now = self.clock()
        if steps_done < self.steps and now - self._written_at < self.every_s:
            return
        self._written_at = now
        write_json(self.out_dir / PROGRESS, {"steps_done": steps_done, "steps": self.steps,
                                             "first_step": {"steps_done": self._first[0], "at": self._first[1]}})
