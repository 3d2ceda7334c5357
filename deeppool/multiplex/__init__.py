"""Multiplexing: background training jobs on the idle windows a burst-parallel plan leaves.

``deeppool run plan.json --background bg.py --mux gate`` (or :func:`run`)
trains ``bg.py`` on the ranks and in the windows ``plan.predicted.idle_windows``
names, driven by the executor's idle-window events, while a feedback controller
keeps the foreground's slowdown under a target. Modes (:class:`MuxMode`):
``none``, ``sched_idle`` and ``gate`` on CPU (a process per hosting rank);
``priority`` (a thread on a low-priority CUDA stream, CUDA-graph pieces) and
``mps`` on a GPU. See ``docs/multiplex.md``.
"""

from deeppool.multiplex.api import run
from deeppool.multiplex.config import ABSchedule, BackgroundConfig, MuxMode
from deeppool.multiplex.metrics import MultiplexReport

__all__ = ["ABSchedule", "BackgroundConfig", "MultiplexReport", "MuxMode", "run"]
