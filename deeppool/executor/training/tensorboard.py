"""``deeppool run --tensorboard DIR``: a run's figures as TensorBoard scalars, live.

While the run goes on, :class:`LiveScalars` follows ``<out>/steps.jsonl`` (rank 0 appends every step's
figures each time the ranks gather them, every ``--monitor-every`` steps) and writes, per step,
``train/loss`` (the global mean loss), ``train/iteration_ms`` (the slowest rank's step time),
``train/samples_per_s`` (the step's global batch over it) and, with ``--monitor gns``,
``gns/noise_scale``. When the run ends it writes what only the end knows: ``gns/grad_sq`` and
``gns/trace`` (rank 0's readings, from its Chrome trace) and, with ``--background``, the multiplexer's
figures as ``background/<name>`` at the last step. ``torch.utils.tensorboard`` needs the ``tensorboard``
package.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from deeppool.errors import DeeppoolError
from deeppool.executor.training.outputs import STEPS

POLL_S = 1.0
"""How often the run's step file is read for new lines."""
_END_ONLY = ("grad_sq", "trace")
"""The noise-scale monitor's readings that only rank 0's trace holds (written when the run ends)."""


def check_available() -> None:
    """Refuse ``--tensorboard`` up front when the ``tensorboard`` package is missing."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise DeeppoolError("--tensorboard needs the tensorboard package: pip install tensorboard") from None


class LiveScalars:
    """A thread that writes each step of the run in ``out_dir`` to ``log_dir`` as soon as rank 0 logs it.

    Use as a context manager around the run: leaving it reads the file a last time, writes the end-of-run
    figures (:meth:`finish`) and closes the writer."""

    def __init__(self, out_dir: Path, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.out_dir = out_dir
        self.writer = SummaryWriter(log_dir=str(log_dir))
        self.written = 0
        self._offset = 0
        self._last_step = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="tensorboard", daemon=True)

    def __enter__(self) -> LiveScalars:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()
        if exc[0] is None:
            self.finish()
        self.writer.close()

    def _follow(self) -> None:
        while not self._stop.wait(POLL_S):
            self.poll()

    def poll(self) -> None:
        """Write the steps appended since the last read (whole lines only; each step once)."""
        path = self.out_dir / STEPS
        if not path.is_file():
            return
        with path.open("rb") as handle:
            handle.seek(self._offset)
            chunk = handle.read()
        complete = chunk[:chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        for raw in complete.splitlines():
            self._write_step(json.loads(raw))
        self.writer.flush()

    def _write_step(self, line: dict[str, Any]) -> None:
        step = int(line["step"])
        if step <= self._last_step:
            return
        self._last_step = step
        ms = float(line["iteration_ms"])
        self.writer.add_scalar("train/loss", float(line["loss"]), step)
        self.writer.add_scalar("train/iteration_ms", ms, step)
        self.written += 2
        if ms > 0:
            self.writer.add_scalar("train/samples_per_s", int(line["samples"]) / (ms / 1e3), step)
            self.written += 1
        if line.get("gns") is not None:
            self.writer.add_scalar("gns/noise_scale", float(line["gns"]), step)
            self.written += 1

    def finish(self) -> None:
        """What only the end of the run knows: rank 0's noise-scale readings and the background's figures."""
        for step, values in enumerate(_counters(self.out_dir / "trace-rank0.json", "gns")):
            for name in _END_ONLY:
                if isinstance(values.get(name), (int, float)):
                    self.writer.add_scalar(f"gns/{name}", values[name], step)
                    self.written += 1
        summary_path = self.out_dir / "summary.json"
        if not summary_path.is_file():
            return
        summary = json.loads(summary_path.read_text())
        last = max(len(summary.get("losses", [])), 1) - 1
        for name, value in _numbers(summary.get("multiplex") or {}).items():
            self.writer.add_scalar(f"background/{name}", value, last)
            self.written += 1


def _counters(path: Path, name: str) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    trace = json.loads(path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [event.get("args", {}) for event in events if event.get("ph") == "C" and event.get("name") == name]


def _numbers(report: dict[str, Any]) -> dict[str, float]:
    return {key: float(value) for key, value in report.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}
