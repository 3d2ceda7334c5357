"""Atomic JSON writes stay whole when several processes write one file at once."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

from deeppool.plans.jsonio import write_json


def _write_many(path: str, writer: int) -> None:
    for step in range(200):
        write_json(path, {"writer": writer, "step": step, "pad": "x" * 4096})


def test_concurrent_writers_of_one_file_never_fail_and_leave_it_whole(tmp_path: Path) -> None:
    target = tmp_path / "cache" / "graph.json"
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_write_many, args=(str(target), n)) for n in range(4)]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join(60)
    assert [writer.exitcode for writer in writers] == [0, 0, 0, 0]
    final = json.loads(target.read_text())
    assert final["step"] == 199 and final["writer"] in range(4)
    assert sorted(path.name for path in target.parent.iterdir()) == ["graph.json"]
