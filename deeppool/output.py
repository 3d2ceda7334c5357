"""Where the commands print: a terminal's width, and no wrapping or cutting when the output is not a terminal."""

from __future__ import annotations

import sys

from rich.console import Console

PIPE_WIDTH = 400
"""Wide enough that a table or summary line piped to a file or a log is never wrapped or cut."""


def console(*, stderr: bool = False) -> Console:
    """A console for stdout (or stderr): the terminal's width there, else one that never wraps."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else PIPE_WIDTH, soft_wrap=not stream.isatty())
