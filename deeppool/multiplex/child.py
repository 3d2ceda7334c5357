"""The background process of one hosting rank: ``python -m deeppool.multiplex.child SPEC.json``.

It trains the background job (:class:`~deeppool.multiplex.job.BackgroundJob`)
as its parent, the rank's process, tells it over stdin, one line per message:

* ``w DEADLINE [overrun]`` (gated modes): an idle window is open until the
  ``time.perf_counter()`` instant DEADLINE; do micro-steps, each sized from the
  measured time per row, while they fit (``overrun``, on a rank that runs no
  layer: while time is left, the last one may end after DEADLINE), then wait
  for the next token. A token
  that arrives after its deadline is dropped. In ``gate`` mode the parent
  also stops the process (``SIGSTOP``) when the window closes and continues
  it when the next opens; a micro-step cut by the stop resumes in that window.
* ``go`` / ``pause`` (free modes): train continuously / stop until ``go``.
* ``q``: save a checkpoint and the statistics, exit 0 (the statistics go to a
  file, or, for a guest of another account, as one line on stdout).

With ``steps`` in its spec (a coordinator's guest, :mod:`deeppool.multiplex.guests`)
it stops by itself once its checkpoint's step count reaches it, saves and exits
0; with ``progress`` it writes ``{"state": "running", "steps": N}`` there
(atomically, at most every :data:`PROGRESS_EVERY_S`) as it trains.

It runs under ``SCHED_IDLE`` except in mode ``none`` (with ``idle_after_load``
in its spec, a guest joining a running host, only once it has loaded its model
and warmed up: the host never waits for it, and a loading starved by the
foreground would never be ready), uses one torch thread,
and dies with its parent (``PR_SET_PDEATHSIG``). At exit, whatever the cause,
it writes its statistics (``stats`` in the spec) atomically; a failure is
written there too and the exit code is 1.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from deeppool.executor.config import OptimizerConfig
from deeppool.multiplex.config import MuxMode
from deeppool.multiplex.job import BackgroundJob, load_background
from deeppool.plans import Optimizer

PR_SET_PDEATHSIG = 1
MAX_SPANS = 20_000
PROGRESS_EVERY_S = 0.5
"""The least time between two writes of a guest's progress file."""


@dataclass
class Stats:
    """What the parent reads back: busy CPU time, samples, losses, and spans for the trace."""

    pid: int
    start_step: int = 0
    steps: int = 0
    samples: int = 0
    busy_s: float = 0.0
    tokens: int = 0
    dropped_tokens: int = 0
    losses: list[float] = field(default_factory=list)
    spans: list[tuple[float, float]] = field(default_factory=list)
    window_busy_ms: list[float] = field(default_factory=list)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Lines:
    """Lines from a file descriptor, without Python's buffering (so ``select`` tells the truth)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = b""
        self.closed = False

    def pending(self) -> bool:
        """Whether a message is waiting (a newer window, or quit), without blocking."""
        return b"\n" in self._buffer or self.closed or bool(select.select([self.fd], [], [], 0)[0])

    def next(self, timeout: float | None) -> str | None:
        """The next line, or None after ``timeout`` seconds (None: wait) or at end of file ("q")."""
        while b"\n" not in self._buffer:
            if self.closed:
                return "q"
            ready, _, _ = select.select([self.fd], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(self.fd, 4096)
            if not chunk:
                self.closed = True
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode().strip()


class Worker:
    """Runs the job as the messages say, accounting CPU time per piece of work."""

    def __init__(self, job: BackgroundJob, stats: Stats, every: int, per_row_s: float | None = None, *,
                 limit: int | None = None, progress: Path | None = None) -> None:
        """``limit``: the step count (the checkpoint's) at which the job is done; ``progress``: where to say how
        far it is."""
        self.job, self.stats, self.every = job, stats, every
        self.per_row_s = per_row_s
        self.limit, self.progress = limit, progress
        self._reported = 0.0

    @property
    def done(self) -> bool:
        """Whether the job has trained the steps it was asked for (never, without a limit)."""
        return self.limit is not None and self.job.step >= self.limit

    def report(self, *, force: bool = False) -> None:
        """Write the progress file (at most every :data:`PROGRESS_EVERY_S` unless ``force``)."""
        now = time.monotonic()
        if self.progress is None or (not force and now - self._reported < PROGRESS_EVERY_S):
            return
        self._reported = now
        tmp = self.progress.with_name(self.progress.name + ".tmp")
        tmp.write_text(json.dumps({"state": "running", "steps": self.job.step}))
        os.replace(tmp, self.progress)

    def piece(self, rows: int | None) -> None:
        cpu, wall = time.process_time(), time.perf_counter()
        done = self.job.micro_step(rows)
        busy = time.process_time() - cpu
        self.stats.busy_s += busy
        if len(self.stats.spans) < MAX_SPANS:
            self.stats.spans.append((wall, time.perf_counter()))
        per_row = busy / done.rows  # CPU time: a piece preempted by the foreground must not look slow
        self.per_row_s = per_row if self.per_row_s is None else 0.7 * self.per_row_s + 0.3 * per_row
        if done.stepped:
            self.stats.steps += 1
            self.stats.samples += self.job.batch
            self.stats.losses.append(float(done.loss or 0.0))
            if self.job.step % self.every == 0 or self.done:
                self.job.save()
            self.report(force=self.done)

    def window(self, deadline: float, lines: Lines, *, overrun: bool = False) -> None:
        """Micro-steps while they fit before ``deadline`` and no newer message waits (the window has closed);
        ``overrun`` (the rank runs no layer): while time is left, the last may end after the deadline."""
        self.stats.tokens += 1
        if time.perf_counter() >= deadline:
            self.stats.dropped_tokens += 1
            self.stats.window_busy_ms.append(0.0)
            return
        before = self.stats.busy_s
        while not lines.pending() and not self.done:
            left = deadline - time.perf_counter()
            if overrun and left <= 0:
                break
            if self.per_row_s is None:
                rows = 1
            else:
                rows = max(int(left / self.per_row_s), 1 if overrun else 0)
                if rows < 1:
                    self.per_row_s *= 0.9  # an estimate that never fits again would never be corrected
                    break
            self.piece(rows)
        self.stats.window_busy_ms.append(1e3 * (self.stats.busy_s - before))

    def gated(self, lines: Lines) -> None:
        while not self.done:
            message = lines.next(None)
            if message is None or message == "q":
                return
            kind, *args = message.split()
            if kind == "w":
                self.window(float(args[0]), lines, overrun="overrun" in args[1:])

    def free(self, lines: Lines) -> None:
        running = False
        while not self.done:
            message = lines.next(0.0 if running else None)
            if message == "q":
                return
            if message in ("go", "pause"):
                running = message == "go"
            if running:
                self.piece(None)


def _die_with_parent(parent: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(0)


def _write(path: Path, stats: Stats) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(stats.to_json()))
    os.replace(tmp, path)


def _send(fd: int, stats: Stats) -> None:
    data = (json.dumps(stats.to_json()) + "\n").encode()
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass  # the parent is gone: nobody to tell


def _optimizer(spec: dict[str, Any]) -> OptimizerConfig:
    return OptimizerConfig(kind=Optimizer(spec["kind"]), lr=spec["lr"], momentum=spec["momentum"])


def run(spec: dict[str, Any]) -> int:
    """Train as the parent says; the statistics go to ``stats`` (a file), or, where that is None (a guest of
    another account, whose host cannot read its files), as the last line of stdout."""
    _die_with_parent(int(spec["parent"]))
    mode = MuxMode(spec["mode"])
    idle_after_load = bool(spec.get("idle_after_load"))
    if mode is not MuxMode.NONE and not idle_after_load:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    torch.set_num_threads(1)
    stats = Stats(pid=os.getpid())
    stats_path = Path(spec["stats"]) if spec.get("stats") else None
    out = os.dup(1)  # the parent's pipe: "ready", and the statistics line where there is no file
    os.dup2(2, 1)  # anything the model prints goes to the log, never into the parent's pipe
    try:
        checkpoint = Path(spec["checkpoint"]) if spec.get("checkpoint") else None
        job = BackgroundJob(load_background(Path(spec["model"])), batch=int(spec["batch"]),
                            optimizer=_optimizer(spec["optimizer"]), seed=int(spec["seed"]),
                            device=torch.device(spec.get("device", "cpu")), checkpoint=checkpoint)
        stats.start_step = job.step
        per_row_s = job.warm_up() if mode.gated else None  # a cold first piece would keep it out of windows
        limit = int(spec["steps"]) if spec.get("steps") is not None else None
        progress = Path(spec["progress"]) if spec.get("progress") else None
        worker = Worker(job, stats, int(spec["checkpoint_every"]), per_row_s, limit=limit, progress=progress)
        worker.report(force=True)
        lines = Lines(sys.stdin.fileno())
        if mode is not MuxMode.NONE and idle_after_load:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        os.write(out, b"ready\n")
        (worker.gated if mode.gated else worker.free)(lines)
        job.save()
        return 0
    except BaseException as err:  # noqa: BLE001  the parent reads the failure from the statistics
        stats.error = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
        traceback.print_exc()
        return 1
    finally:
        if stats_path is None:
            _send(out, stats)
        else:
            _write(stats_path, stats)


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    sys.exit(run(spec))


if __name__ == "__main__":
    main()
