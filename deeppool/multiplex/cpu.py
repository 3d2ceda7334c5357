"""A background process per hosting rank: the CPU mode, and the process side of MPS.

The rank's process starts ``python -m deeppool.multiplex.child`` with a spec
file, talks to it over its stdin (tokens for windows, go/pause for the A/B
blocks) and reads its statistics file when it has stopped. A coordinator's
guest of another account is started by the host's broker instead
(:mod:`deeppool.coordinator.guest`): the same child, as the guest's account,
its statistics read from its stdout, and its stop and continue a freeze and
thaw of its cgroup. In ``gate`` mode
the child is also held stopped outside windows: ``SIGCONT`` when a window
opens (after its token is written), ``SIGSTOP`` the moment it closes, so the
background never computes while the foreground's rank does, whatever its
piece sizes and however late it woke. The child cannot
take the rank down: a write to a dead child marks it dead and is otherwise
ignored, and its failure is reported from its statistics, its exit code and
its log. :meth:`ProcessBackground.stop` asks it to quit, then terminates, then
kills, and always waits, so no process is left behind.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, IO

from deeppool.multiplex.config import BackgroundConfig, MuxMode
from deeppool.multiplex.metrics import RankBackground

Spawn = Callable[..., Any]
"""Starts the child: :class:`subprocess.Popen`, or a guest's broker
(:class:`~deeppool.multiplex.remote.BrokeredChild`, whose ``send_signal`` freezes and thaws)."""
MAX_PIPED = 16 << 20
"""The most read of a child's statistics line on its pipe."""


def child_spec(config: BackgroundConfig, *, rank: int, stats: Path, device: str = "cpu") -> dict[str, Any]:
    checkpoint = config.checkpoint(rank)
    return {
        "model": str(config.model), "batch": config.batch, "mode": config.mode.value, "seed": config.seed + rank,
        "optimizer": {"kind": config.optimizer.kind.value, "lr": config.optimizer.lr,
                      "momentum": config.optimizer.momentum},
        "checkpoint": None if checkpoint is None else str(checkpoint), "checkpoint_every": config.checkpoint_every,
        "stats": str(stats), "parent": os.getpid(), "device": device,
    }


class ProcessBackground:
    """One child process and its pipe; every method is safe after the child has died."""

    def __init__(self, spec: dict[str, Any], *, rank: int, folder: Path, env: dict[str, str] | None = None,
                 spawn: Spawn = subprocess.Popen) -> None:
        self.rank = rank
        folder.mkdir(parents=True, exist_ok=True)
        self.stats_path = Path(spec["stats"]) if spec.get("stats") else None  # None: on the pipe (a guest)
        if self.stats_path is not None:
            self.stats_path.unlink(missing_ok=True)
        self.log_path = folder / f"background-rank{rank}.log"
        spec_path = folder / f"background-rank{rank}.json"
        spec_path.write_text(json.dumps(spec))
        self._log: IO[bytes] = self.log_path.open("wb")
        self.proc: Any = spawn(
            [sys.executable, "-m", "deeppool.multiplex.child", str(spec_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env={**os.environ, **(env or {})},
        )
        (folder / f"background-rank{rank}.pid").write_text(f"{self.proc.pid}\n")
        self.dead = False
        self.ready = False
        self.stops = MuxMode(spec["mode"]) is MuxMode.GATE
        self.closed_ms: list[float | None] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _send(self, line: str) -> None:
        if self.dead or self.proc.stdin is None:
            return
        try:
            self.proc.stdin.write(f"{line}\n".encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            self.dead = True

    def wait_ready(self, timeout_s: float) -> None:
        """Block until the child has loaded its model (it prints one line), failed, or ``timeout_s`` passed."""
        if self.ready or self.dead or self.proc.stdout is None:
            return
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else b""
        self.ready = line.strip() == b"ready"
        self.dead = not self.ready and self.proc.poll() is not None

    def admit(self, deadline_s: float, window_ms: float, *, overrun: bool = False) -> None:
        del window_ms  # the child needs only the deadline
        self._send(f"w {deadline_s:.6f}" + (" overrun" if overrun else ""))
        self._signal(signal.SIGCONT)

    def close(self, window_ms: float | None) -> None:
        self._signal(signal.SIGSTOP)
        self.closed_ms.append(window_ms)

    def _signal(self, sig: signal.Signals) -> None:
        """Stop or continue the child (a guest of another account: freeze or thaw its group)."""
        if self.stops and not self.dead:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                self.dead = True

    def running(self, on: bool) -> None:
        self._send("go" if on else "pause")

    def stop(self, timeout_s: float = 10.0) -> RankBackground:
        self._signal(signal.SIGCONT)
        self._send("q")
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        piped = _drain(self.proc.stdout, timeout_s) if self.stats_path is None else b""
        code = _reap(self.proc, timeout_s)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()
        if self.stats_path is None:
            return RankBackground.parse(self.rank, self.proc.pid, _last_line(piped), code, self.log_path,
                                        closed_ms=self.closed_ms)
        return RankBackground.read(self.rank, self.proc.pid, self.stats_path, code, self.log_path,
                                   closed_ms=self.closed_ms)


def _drain(stream: IO[bytes] | None, timeout_s: float) -> bytes:
    """What the child writes to its stdout until it closes it (its statistics line last), at most
    :data:`MAX_PIPED` bytes and ``timeout_s`` seconds."""
    data, deadline = b"", time.monotonic() + timeout_s
    while stream is not None and len(data) < MAX_PIPED and time.monotonic() < deadline:
        if not select.select([stream], [], [], max(0.0, deadline - time.monotonic()))[0]:
            break
        chunk = stream.read1(MAX_PIPED)  # type: ignore[attr-defined]
        if not chunk:
            break
        data += chunk
    return data


def _last_line(data: bytes) -> Any:
    """The JSON of the last complete line (None when there is none, or it is not JSON)."""
    lines = data.splitlines()
    try:
        return json.loads(lines[-1]) if lines and data.endswith(b"\n") else None
    except (ValueError, RecursionError):
        return None


def _reap(proc: Any, timeout_s: float) -> int:
    """Wait; then SIGTERM; then SIGKILL: the child is always waited for."""
    for action in (None, proc.terminate, proc.kill):
        if action is not None:
            try:
                action()
            except ProcessLookupError:
                pass
        try:
            return proc.wait(timeout=timeout_s if action is None else 2.0)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()

