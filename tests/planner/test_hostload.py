"""The profiler's load: the tasks runnable now outside its own process tree, plus one for itself."""

from __future__ import annotations

import os
from pathlib import Path

from deeppool.planner.hostload import runnable_now


def _task(proc: Path, pid: int, tid: int, state: str, parent: int) -> None:
    text = f"{tid} (a (strange) name) {state} {parent} 0 0\n"
    (proc / str(pid)).mkdir(exist_ok=True)
    if pid == tid:
        (proc / str(pid) / "stat").write_text(text)
    (proc / str(pid) / "task" / str(tid)).mkdir(parents=True)
    (proc / str(pid) / "task" / str(tid) / "stat").write_text(text)


def test_the_load_counts_what_runs_now_outside_this_tree_and_this_process_as_one(tmp_path):
    me = os.getpid()
    child = me + 1 if me + 1 != 200 else me + 2
    for pid, tid, state, parent in [(me, me, "R", 1), (me, me + 100_000, "R", 1), (child, child, "R", me),
                                    (200, 200, "R", 1), (200, 201, "R", 1), (200, 202, "S", 1)]:
        _task(tmp_path, pid, tid, state, parent)
    assert runnable_now(samples=2, every_s=0.0, proc=tmp_path) == 3.0, \
        "process 200's two runnable threads, and this process with its threads and children as one"
    (tmp_path / "200" / "task" / "201" / "stat").write_text("201 (x) S 1 0 0\n")
    assert runnable_now(samples=1, proc=tmp_path) == 2.0, "a task that went to sleep no longer counts"


def test_without_proc_the_load_is_the_load_average(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (7.5, 1.0, 1.0))
    assert runnable_now(proc=tmp_path) == 7.5, "no /proc entry for this process (not Linux): the 1-minute average"
