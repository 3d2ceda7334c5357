"""Running a typer app as a command: every user mistake is one line starting ``error:``, exit 2, no traceback."""

from __future__ import annotations

import signal
import sys
import threading

import typer

from deeppool.errors import DeeppoolError
from deeppool.interrupt import EXIT_CODE, MESSAGE, Interrupted, arm_deadline, interrupt_arrived

try:  # typer >= 0.20 carries its own copy of click
    from typer._click import exceptions as click_errors
except ImportError:  # older typer runs on click itself
    from click import exceptions as click_errors


def run_app(app: typer.Typer, args: list[str] | None = None, *, prog_name: str | None = None) -> None:
    """Run ``app``; a usage mistake or a :class:`DeeppoolError` prints one line on stderr and exits with its code.

    A group run with no command (``deeppool``, ``deeppool token``) prints its help and exits 2, as click does.
    Ctrl-C prints ``interrupted`` and exits 130 (typer turns a KeyboardInterrupt into that exit code).
    """
    reported = arm_deadline()
    try:
        code = app(args=args, prog_name=prog_name, standalone_mode=False)
    except click_errors.NoArgsIsHelpError as shown:
        help_text = shown.format_message()  # typer's rich help has printed itself already and left this empty
        if help_text.strip():
            print(help_text)
        sys.exit(shown.exit_code)  # 2, as click and typer exit when a group is run with no command
    except click_errors.UsageError as err:
        print(f"error: {usage_line(err)}", file=sys.stderr)
        sys.exit(2)
    except (typer.Abort, KeyboardInterrupt, Interrupted):
        _interrupted(reported)
    except DeeppoolError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except Exception:
        if interrupt_arrived():  # the interrupt surfaced as another exception (a C extension's import)
            _interrupted(reported)
        raise
    if code == EXIT_CODE:
        _interrupted(reported)


def _interrupted(reported: threading.Event) -> None:
    """Say so and exit 130. A later Ctrl-C is ignored: at shutdown Python puts SIGINT back to the system's
    default, and a signal then would end the process by the signal (exit -2) instead."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    print(MESSAGE, file=sys.stderr, flush=True)
    reported.set()
    sys.exit(EXIT_CODE)


def usage_line(err: click_errors.UsageError) -> str:
    """Click's message on one line, and which command's --help to read."""
    message = " ".join(err.format_message().split())
    command = err.ctx.command_path if err.ctx is not None else "deeppool"
    return f"{message} (see `{command} --help`)"
