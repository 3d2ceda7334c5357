"""Naming a rank that stopped responding, within the communication timeout.

A hung rank (stopped, deadlocked, stuck in a kernel) raises nothing: the ranks
waiting for it fail when their collective times out (``--timeout``) and record
a communication failure. The elastic agent then stops every rank with SIGTERM
and waits 30 s before SIGKILL, which a stopped process never acts on; the hung
rank would then look "killed by SIGKILL", a kill the launcher did itself.

:class:`HangWatch` runs beside the agent in the launcher. Once ranks have
recorded only communication failures (no rank raised an error of its own) and
``grace_s`` has passed, it SIGKILLs every rank that is still alive and has
recorded nothing, and remembers it as hung, so the launcher reports "rank R
stopped responding" within the timeout plus a few seconds. A rank that died
by itself (a real SIGKILL) is already gone and is left to the agent's report.
The rank processes are the launcher's own children, found in ``/proc`` by the
``RANK`` in their environment.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

RecordedRanks = Callable[[], dict[int, str]]
"""Ranks that recorded a failure, and its kind (``peer``, ``crash``...)."""


@dataclass(kw_only=True)
class HangWatch:
    recorded: RecordedRanks
    nproc: int
    grace_s: float = 2.0
    poll_s: float = 0.2
    hung: set[int] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> HangWatch:
        self._thread = threading.Thread(target=self._run, name="deeppool-hangwatch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        first_seen: float | None = None
        while not self._stop.wait(self.poll_s):
            recorded = self.recorded()
            if not recorded or any(kind != "peer" for kind in recorded.values()):
                first_seen = None
                continue
            first_seen = first_seen or time.monotonic()
            if time.monotonic() - first_seen >= self.grace_s:
                self._kill_silent(set(recorded))

    def _kill_silent(self, recorded: set[int]) -> None:
        for rank, pid in rank_processes(os.getpid()).items():
            if rank in recorded or rank in self.hung or rank >= self.nproc:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.hung.add(rank)


def rank_processes(parent: int) -> dict[int, int]:
    """Live (not zombie) children of ``parent`` by their ``RANK``."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        status = _status(entry)
        if status is None or status.get("PPid") != str(parent) or status.get("State", "").startswith("Z"):
            continue
        rank = _rank(entry)
        if rank is not None:
            found[rank] = int(entry.name)
    return found


def _status(entry: Path) -> dict[str, str] | None:
    try:
        lines = (entry / "status").read_text().splitlines()
    except OSError:
        return None
    return {key: value.strip() for key, _, value in (line.partition(":") for line in lines)}


def _rank(entry: Path) -> int | None:
    try:
        environ = (entry / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None
