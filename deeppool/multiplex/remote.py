"""The host's side of a coordinator guest of another account: its processes, asked of the host's broker.

A background job lent a foreground job's idle windows whose account is not
the host's is never started by the host: the host supervisor's broker
(:mod:`deeppool.coordinator.guest`) starts it, as its own account, and hands
the host its pipes and a descriptor of its cgroup's ``cgroup.freeze``.
:class:`BrokeredChild` is that process as the host sees it, with
:class:`subprocess.Popen`'s methods, so
:class:`~deeppool.multiplex.cpu.ProcessBackground` drives it as its own child:
``SIGSTOP`` and ``SIGCONT`` become a freeze and a thaw of its group (a host may
not signal another account's process), its exit code comes over the socket,
and its statistics come on its stdout. :func:`measured` is the preflight's
memory estimate, measured by a process of the guest's.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import IO, Any

from deeppool.errors import DeeppoolError

MAX_MEASURE = 1 << 16
"""The most a host reads of a measuring process's output."""
MEASURE_TIMEOUT_S = 120.0
"""The longest a host waits for a guest's memory estimate."""


class BrokerAbsent(DeeppoolError):
    """The broker's socket does not answer (not listening yet, or gone); the message says why."""


class BrokeredChild:
    """A guest's process as its host sees it: :class:`subprocess.Popen`'s methods over the broker's socket."""

    def __init__(self, conn: socket.socket, pid: int, stdin: int, stdout: int, freeze: int) -> None:
        self._conn, self.pid, self._freeze = conn, pid, freeze
        self.stdin: IO[bytes] | None = os.fdopen(stdin, "wb")
        self.stdout: IO[bytes] | None = os.fdopen(stdout, "rb")
        self.returncode: int | None = None
        self._buffer = b""

    @classmethod
    def start(cls, path: Path, request: dict[str, Any]) -> BrokeredChild:
        """Ask the broker at ``path`` for a process; a one-line error if it starts none
        (:class:`BrokerAbsent` when it does not answer)."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(str(path))
            conn.sendall(json.dumps(request).encode() + b"\n")
            message, fds, _, _ = socket.recv_fds(conn, 4096, 3)
        except OSError as err:
            conn.close()
            raise BrokerAbsent(f"the guest's broker at '{path}' does not answer: {err.strerror or err}") from None
        reply = as_json(message.split(b"\n", 1)[0])
        if len(fds) != 3 or not isinstance(reply.get("pid"), int):
            for fd in fds:
                os.close(fd)
            conn.close()
            raise DeeppoolError(str(reply.get("error") or "the guest's broker started no process"))
        return cls(conn, int(reply["pid"]), *fds)

    def poll(self) -> int | None:
        """The exit code once the broker has sent it (a broker gone: -9), else None; never blocks."""
        while self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            chunk = recv(self._conn)
            if not chunk:
                self.returncode = -signal.SIGKILL
                break
            self._buffer += chunk
            if b"\n" in self._buffer:
                code = as_json(self._buffer.split(b"\n", 1)[0]).get("exit")
                self.returncode = int(code) if isinstance(code, int) and -256 < code < 256 else -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(["guest"], timeout or 0.0)
            select.select([self._conn], [], [], left)
        self.close()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        """SIGSTOP and SIGCONT freeze and thaw the process's group; any other signal asks the broker to kill."""
        if signum in (signal.SIGSTOP, signal.SIGCONT):
            with contextlib.suppress(OSError):
                os.write(self._freeze, b"1" if signum == signal.SIGSTOP else b"0")
        else:
            self.kill()

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.sendall(b"kill\n")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._freeze)
        self._conn.close()


def measured(path: Path) -> dict[str, int]:
    """The guest's memory estimate, measured by a process of the guest's (its failure names the guest's log)."""
    child = BrokeredChild.start(path, {"op": "measure"})
    assert child.stdin is not None and child.stdout is not None
    child.stdin.close()
    data, deadline = b"", time.monotonic() + MEASURE_TIMEOUT_S
    while len(data) < MAX_MEASURE and time.monotonic() < deadline:
        if not select.select([child.stdout], [], [], 1.0)[0]:
            continue
        chunk = child.stdout.read1(MAX_MEASURE)
        if not chunk:
            break
        data += chunk
    child.stdout.close()
    try:
        code = child.wait(30)
    except subprocess.TimeoutExpired:
        child.kill()
        code = child.wait(30)
    lines = data.strip().splitlines()
    figures = as_json(lines[-1]) if lines else {}
    numbers = {name: figures.get(name) for name in ("params", "gradients", "optimizer_state", "activations")}
    if code != 0 or not all(_count(value) for value in numbers.values()):
        raise DeeppoolError("the guest's model could not be measured (its job's log says why)")
    return {name: int(value) for name, value in numbers.items()}  # type: ignore[arg-type]


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 60


def recv(conn: socket.socket) -> bytes:
    """What came on ``conn`` (b"" when it closed or failed)."""
    try:
        return conn.recv(64)
    except OSError:
        return b""


def as_json(line: bytes) -> dict[str, Any]:
    """``line``'s JSON object, or an empty one."""
    try:
        data = json.loads(line)
    except (ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}
