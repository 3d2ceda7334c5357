"""Quiet by default: solver banners and library warnings are shown only with ``deeppool --verbose``.

``--verbose`` (or ``DEEPPOOL_VERBOSE=1``) is recorded in the environment, so the processes a command starts
(plan workers, ranks) follow it too. Quiet, Python warnings are ignored, Hugging Face ``transformers`` logs
errors only, and :func:`native_output_hidden` hides what a C library prints straight to the terminal
(HiGHS prints its banner on stdout before any option can turn it off).
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

VERBOSE_ENV = "DEEPPOOL_VERBOSE"


def configure(verbose: bool) -> None:
    """Set this process, and the processes it starts, verbose or quiet."""
    if verbose:
        os.environ[VERBOSE_ENV] = "1"
    if is_verbose():
        return
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    warnings.simplefilter("ignore")


def is_verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


@contextmanager
def native_output_hidden() -> Iterator[None]:
    """Unless verbose, send what native code writes to stdout to /dev/null while the block runs."""
    if is_verbose():
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
        yield
    finally:
        _flush_c_streams()
        os.dup2(saved, 1)
        os.close(saved)


def _flush_c_streams() -> None:
    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        pass
