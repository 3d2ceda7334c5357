"""The profiler's load: the tasks running now besides it, plus one for itself."""

from __future__ import annotations

import os
from pathlib import Path

from deeppool.planner.profiling.hostload import runnable_now


def fake_task(proc: Path, pid: int, tid: int, state: str, parent: int) -> None:
    """A task of a fake /proc: its stat (and its process's, for the main thread) in state ``state``."""
    text = f"{tid} (a (strange) name) {state} {parent} 0 0\n"
    (proc / str(pid)).mkdir(exist_ok=True)
    if pid == tid:
        (proc / str(pid) / "stat").write_text(text)
    (proc / str(pid) / "task" / str(tid)).mkdir(parents=True)
    (proc / str(pid) / "task" / str(tid) / "stat").write_text(text)


def test_the_load_counts_what_runs_now_besides_this_process_and_this_process_as_one(tmp_path):
    me = os.getpid()
    for pid, tid, state in [(me, me, "R"), (me, me + 100_000, "R"), (me, me + 100_001, "S")]:
        fake_task(tmp_path, pid, tid, state, 1)
    (tmp_path / "stat").write_text("cpu  1 2 3 4\nprocs_running 5\nprocs_blocked 0\n")
    assert runnable_now(proc=tmp_path) == 4.0, \
        "three runnable tasks besides this process's two running threads, and this process as one"
    (tmp_path / "stat").write_text("procs_running 2\n")
    assert runnable_now(proc=tmp_path) == 1.0, "only this process runs: the load is 1"


def test_without_proc_the_load_is_the_load_average(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (7.5, 1.0, 1.0))
    assert runnable_now(proc=tmp_path) == 7.5, "no /proc entry for this process (not Linux): the 1-minute average"
