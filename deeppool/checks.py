"""Command-line checks that run before any work: paths, numbers and device names, each named by its flag.

Every command calls these first, before it imports torch or traces a model,
so a mistake costs well under a second and leaves nothing behind. None of
them creates a file or a folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from deeppool.errors import DeeppoolError

IMAGE_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff", ".webp")
"""What matplotlib's Agg backend writes."""
DEVICE_PATTERN = re.compile(r"^(cpu|cuda(:\d+)?)$")
CPU_RANKS_PER_CORE = 4
"""gloo ranks on CPU share the cores; beyond this many per core a run (or the network probe) measures only
contention."""


def existing_file(path: Path | None, flag: str) -> None:
    """``path`` (when given) is a readable file."""
    if path is None:
        return
    if path.is_dir():
        raise DeeppoolError(f"{flag} '{path}' is a folder: give a file")
    if not path.is_file():
        raise DeeppoolError(f"{flag} '{path}' does not exist: check the path")


def new_file(path: Path | None, flag: str, suffixes: tuple[str, ...] = ()) -> None:
    """``path`` (when given) can be written as a file: not a folder, under a writable folder, a known suffix."""
    if path is None:
        return
    if path.is_dir():
        raise DeeppoolError(f"{flag} '{path}' is a folder: give a file name, e.g. {path / 'out'}{_first(suffixes)}")
    _writable_parent(path, flag)
    if suffixes and path.suffix.lower() not in suffixes:
        suffix = path.suffix or "(no suffix)"
        raise DeeppoolError(f"{flag} '{path}': '{suffix}' is not an image format; use one of {', '.join(suffixes)}")


def out_folder(path: Path, flag: str) -> None:
    """``path`` is a folder or can become one: not an existing file, under a writable parent."""
    if path.exists() and not path.is_dir():
        raise DeeppoolError(f"{flag} '{path}' is a file: give a folder (it is created when missing)")
    if path.exists() and not os.access(path, os.W_OK):
        raise DeeppoolError(f"{flag} '{path}' is not writable")
    _writable_parent(path, flag)


def distinct(paths: dict[str, Path | None]) -> None:
    """No two output flags name the same file."""
    seen: dict[Path, str] = {}
    for flag, path in paths.items():
        if path is None:
            continue
        resolved = path.resolve()
        if resolved in seen:
            raise DeeppoolError(f"{flag} and {seen[resolved]} both name '{path}': give different files")
        seen[resolved] = flag


def at_least(value: float | None, lowest: float, flag: str) -> None:
    if value is not None and value < lowest:
        raise DeeppoolError(f"{flag} {value} must be at least {lowest}")


def positive(value: float | None, flag: str) -> None:
    if value is not None and not value > 0:
        raise DeeppoolError(f"{flag} {value} must be positive")


def device(text: str, flag: str) -> None:
    """``cpu``, or ``cuda[:N]`` naming a CUDA device that is here (only then is torch imported)."""
    match = DEVICE_PATTERN.match(text)
    if not match:
        raise DeeppoolError(f"{flag} '{text}' is not a device this tool measures on: use cpu or cuda[:N]")
    if text == "cpu":
        return
    from deeppool.device.cuda import CudaGpu

    count = CudaGpu().count()
    index = int(match.group(2)[1:]) if match.group(2) else 0
    if index >= count:
        raise DeeppoolError(
            f"{flag} {text}: {'no CUDA device is' if count == 0 else f'only {count} CUDA device(s) are'} visible here; "
            "measure on cpu, or on a machine with a GPU (`deeppool plan --device-model a100` estimates without one)"
        )


def ints(text: str | None, flag: str, example: str) -> tuple[int, ...]:
    """Comma-separated integers from the command line."""
    if not text:
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise DeeppoolError(f"{flag} '{text}' is not comma-separated integers, e.g. {example}") from None


def positive_ints(text: str | None, flag: str, example: str) -> tuple[int, ...]:
    values = ints(text, flag, example)
    if any(value < 1 for value in values):
        raise DeeppoolError(f"{flag} '{text}': every value must be at least 1, e.g. {example}")
    return values


def _writable_parent(path: Path, flag: str) -> None:
    """The nearest existing folder above ``path`` is writable (missing folders are created on writing)."""
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise DeeppoolError(f"{flag} '{path}': '{parent}' is a file, not a folder")
    if not os.access(parent, os.W_OK):
        raise DeeppoolError(f"{flag} '{path}': folder '{parent}' is not writable")


def _first(suffixes: tuple[str, ...]) -> str:
    return suffixes[0] if suffixes else ".json"
