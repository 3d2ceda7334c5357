"""Multiplexing: background training jobs on the idle windows a burst-parallel plan leaves.

``deeppool run plan.json --background bg.py --mux gate`` (or :func:`run`)
trains ``bg.py`` on the ranks and in the windows ``plan.predicted.idle_windows``
names, driven by the executor's idle-window events, while a feedback controller
keeps the foreground's slowdown under a target. Modes (:class:`MuxMode`):
``none``, ``sched_idle`` and ``gate`` on CPU (a process per hosting rank);
``priority`` (a thread on a low-priority CUDA stream, CUDA-graph pieces) and
``mps`` on a GPU. See ``docs/multiplex.md``.
"""

import importlib
from typing import Any

_HOMES = {
    "run": "api", "ABSchedule": "config", "BackgroundConfig": "config", "MuxMode": "config",
    "MultiplexReport": "metrics",
}
"""Where each public name lives: imported on first use, so ``deeppool --help`` never loads torch."""

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'deeppool.multiplex' has no attribute '{name}'")
    return getattr(importlib.import_module(f"deeppool.multiplex.{_HOMES[name]}"), name)
