"""How busy the host is now: the tasks runnable besides the caller, read from ``/proc``.

The 1-minute load average lags what the profiler needs to know: after a
multi-rank run it stays high for a minute while nothing runs, which would mark
quiet measurements as busy and keep the cache from measuring again
(``docs/notes/0003-layer-time-cache-trust.md``). So the profiler reads the
running tasks other than its own (before and after every round of passes, so a
batch's load is the highest of several readings), and counts itself as one: a
figure on the load average's scale that says what runs now.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def runnable_now(proc: Path = PROC) -> float:
    """The tasks runnable now with the calling process counted as one (the load average's scale): 1 + the
    host's running tasks (``procs_running`` of ``/proc/stat``) less the caller's own; the 1-minute load
    average where ``proc`` cannot be read (not Linux). Cheap (a few files), as the profiler reads it around
    every round of passes; :func:`runnable_outside` also leaves out a whole process tree, for a benchmark
    that samples once a second."""
    own, stat = proc / str(os.getpid()), proc / "stat"
    if not own.is_dir() or not stat.is_file():
        return os.getloadavg()[0]
    mine = sum(state == "R" for state, _ in filter(None, map(_stat, own.glob("task/*/stat"))))
    return 1.0 + max(0, _procs_running(stat) - mine)


def _procs_running(stat: Path) -> int:
    """The host's running and runnable tasks now (``procs_running``); 0 where the line is missing."""
    for line in stat.read_text().splitlines():
        if line.startswith("procs_running "):
            return int(line.split()[1])
    return 0


def runnable_outside(root: int, proc: Path = PROC) -> int:
    """Tasks in state R (running or runnable) whose process is neither ``root`` nor a descendant of it."""
    parents, states = {}, {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            found = _stat(entry / "stat")
            if found is not None:
                parents[int(entry.name)] = found[1]
                states[int(entry.name)] = [state for state, _ in filter(None, map(_stat, entry.glob("task/*/stat")))]
    tree, frontier = {root}, [root]
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    while frontier:
        for child in children.get(frontier.pop(), ()):
            tree.add(child)
            frontier.append(child)
    return sum(state == "R" for pid, tasks in states.items() if pid not in tree for state in tasks)


def _stat(path: Path) -> tuple[str, int] | None:
    """(state, parent pid) from a /proc stat file; None where the task has gone."""
    try:
        fields = path.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])
