"""The `deeppool` console script's entry point, called in this process: what a user runs, minus the
interpreter start-up (a subprocess adds nothing to what these tests check)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from deeppool.cli import main


@dataclass(frozen=True)
class Result:
    code: int
    stdout: str
    stderr: str


def deeppool(capture: pytest.CaptureFixture[str], *args: str) -> Result:
    """``deeppool ARGS`` through :func:`deeppool.cli.main`; ``capture`` is capsys, or capfd to see the ranks too."""
    capture.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 1
    captured = capture.readouterr()
    return Result(code=code, stdout=captured.out, stderr=captured.err)
