"""Ctrl-C: a command stops, prints one line ``interrupted``, exits 130 and removes what it had begun to write.

:func:`removed_if_interrupted` wraps a command's work: the outputs it names that did not exist when the work
began (a plan file, a results folder) are removed if an interrupt ends it, so a half-written file or an empty
folder never looks like a result. :func:`deeppool.entry.run_app` prints the line and sets the exit status.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar, cast

from deeppool.errors import DeeppoolError

EXIT_CODE = 130
"""128 + SIGINT, what a shell reports for a program Ctrl-C stopped."""
MESSAGE = "interrupted"
CommandT = TypeVar("CommandT", bound=Callable[..., object])
GRACE_S = 3.5
"""How long the work may take to stop after Ctrl-C; a torch op in C holds the interrupt until it returns."""
SHUTDOWN_S = 0.5
"""How long the interpreter's own exit may take once the work has stopped."""


class Interrupted(DeeppoolError):
    """Ctrl-C (or SIGINT) stopped the work; raised where an interrupt arrives as something else (a rank's exit)."""

    exit_code = EXIT_CODE

    def __init__(self) -> None:
        super().__init__(MESSAGE)


AGENT_ENV = "TORCHELASTIC_RUN_ID"
"""Set in the ranks that torchrun's agent (``deeppool run`` runs one) starts, each in a session of its own."""
_PR_SET_PDEATHSIG = 1


def quiet_rank() -> None:
    """A rank under an agent: Ctrl-C ends it at once and silently, and so does its agent's death.

    The agent answers Ctrl-C (it stops the ranks with SIGINT and ``deeppool run`` says ``interrupted``);
    a rank's own KeyboardInterrupt would only print a traceback per rank. A rank whose agent is gone
    (killed, or ended by :func:`arm_deadline`) is killed by the kernel rather than left running.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the agent died before the request took effect
        os._exit(EXIT_CODE)


@contextmanager
def children_start_deaf() -> Iterator[None]:
    """Start worker processes inside this: they begin with Ctrl-C ignored (it would print a traceback per worker
    while they import), and their initializer :func:`die_on_interrupt` then lets Ctrl-C end them silently."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def die_on_interrupt() -> None:
    """A worker process's initializer: Ctrl-C ends it at once and silently; its parent reports the interrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def arm_deadline(grace_s: float = GRACE_S) -> threading.Event:
    """After Ctrl-C, end the process ``grace_s`` later if the work has not stopped by itself.

    Python runs its SIGINT handler only between bytecodes, so a long torch op on a loaded machine holds
    the interrupt for seconds. The signal's wake-up byte reaches a watcher thread at once; if the process
    is still alive ``grace_s`` later, the watcher exits 130 itself, printing the line unless the returned
    event says it was printed already. Armed once per process (a host that set a wake-up fd keeps it).
    """
    reported = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        return reported
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt_once)
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    if previous != -1:
        signal.set_wakeup_fd(previous)
        os.close(read_end)
        os.close(write_end)
        return reported
    threading.Thread(target=_watch, args=(read_end, grace_s, reported), name="interrupt-deadline",
                     daemon=True).start()
    return reported


def _interrupt_once(signum: int, frame: object) -> None:
    """Ctrl-C: raise KeyboardInterrupt once, and ignore the next ones while the work stops. A second
    KeyboardInterrupt raised while the first one's clean-up runs would escape it, and Python then ends the
    process by the signal (exit -2) with the clean-up half done; the watcher still ends it in time."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def interrupt_arrived() -> bool:
    """Whether Ctrl-C has reached this process (:func:`_interrupt_once` ignores SIGINT from then on). An
    exception then is how the interrupt surfaced: a C extension being imported turns the KeyboardInterrupt
    into ``ImportError: initialization failed`` (highspy did, when Ctrl-C landed while it was imported)."""
    return threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def _watch(read_end: int, grace_s: float, reported: threading.Event) -> None:
    while signal.SIGINT not in os.read(read_end, 64):
        continue
    if reported.wait(grace_s):
        reported.clear()
        reported.wait(SHUTDOWN_S)  # the work stopped and said so: its own exit normally ends the process first
    else:
        print(MESSAGE, file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)


@contextmanager
def removed_if_interrupted(*outputs: Path | None) -> Iterator[None]:
    """Run the block; if an interrupt ends it, remove each of ``outputs`` that did not exist before it (also
    when the interrupt surfaced as another exception, :func:`interrupt_arrived`)."""
    fresh = tuple(path for path in outputs if path is not None and not path.exists())
    try:
        yield
    except BaseException as err:
        if isinstance(err, KeyboardInterrupt | Interrupted) or interrupt_arrived():
            for path in fresh:
                _remove(path)
        raise


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def removes_if_interrupted(*parameters: str) -> Callable[[CommandT], CommandT]:
    """Decorate a command: the paths its ``parameters`` name are :func:`removed_if_interrupted`."""

    def decorate(command: CommandT) -> CommandT:
        signature = inspect.signature(command)

        @functools.wraps(command)
        def guarded(*args: object, **kwargs: object) -> object:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            with removed_if_interrupted(*(bound.arguments[name] for name in parameters)):
                return command(*args, **kwargs)

        return cast(CommandT, guarded)

    return decorate
