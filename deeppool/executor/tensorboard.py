"""``deeppool run --tensorboard DIR``: a run's figures as TensorBoard scalars, written when the run ends.

From the run's own outputs (``summary.json`` and every rank's Chrome trace), per step: ``train/loss``
(the global mean loss), ``train/iteration_ms`` (the slowest rank's iteration span) and
``train/samples_per_s`` (the global batch over it); with ``--monitor gns``, ``gns/grad_sq``,
``gns/trace`` and ``gns/noise_scale`` (rank 0's readings, one per step); with ``--background``, the
multiplexer's figures as ``background/<name>`` at the last step (background samples per second, the
foreground's slowdown...). ``torch.utils.tensorboard`` needs the ``tensorboard`` package.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from deeppool.errors import DeeppoolError


def check_available() -> None:
    """Refuse ``--tensorboard`` up front when the ``tensorboard`` package is missing."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise DeeppoolError("--tensorboard needs the tensorboard package: pip install tensorboard") from None


def write_scalars(out_dir: Path, log_dir: Path) -> int:
    """Write the run in ``out_dir`` as scalars under ``log_dir``; returns how many were written."""
    from torch.utils.tensorboard import SummaryWriter

    summary = json.loads((out_dir / "summary.json").read_text())
    iterations = _iteration_ms(out_dir)
    batch = summary["global_batch"]
    written = 0
    with SummaryWriter(log_dir=str(log_dir)) as writer:
        for step, loss in enumerate(summary.get("losses", [])):
            writer.add_scalar("train/loss", loss, step)
            written += 1
        for step, ms in sorted(iterations.items()):
            writer.add_scalar("train/iteration_ms", ms, step)
            writer.add_scalar("train/samples_per_s", batch / (ms / 1e3), step)
            written += 2
        for step, values in enumerate(_counters(out_dir / "trace-rank0.json", "gns")):
            for name, value in values.items():
                if isinstance(value, (int, float)):
                    writer.add_scalar(f"gns/{name}", value, step)
                    written += 1
        last = max(len(summary.get("losses", [])), 1) - 1
        for name, value in _numbers(summary.get("multiplex") or {}).items():
            writer.add_scalar(f"background/{name}", value, last)
            written += 1
    return written


def _iteration_ms(out_dir: Path) -> dict[int, float]:
    """Each step's slowest iteration span over every rank's trace (ms)."""
    slowest: dict[int, float] = defaultdict(float)
    for path in out_dir.glob("trace-rank*.json"):
        for event in _events(path):
            if event.get("name") == "iteration" and event.get("ph") == "X":
                step = int(event["args"]["step"])
                slowest[step] = max(slowest[step], float(event["dur"]) / 1e3)
    return dict(slowest)


def _counters(path: Path, name: str) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [event.get("args", {}) for event in _events(path) if event.get("ph") == "C" and event.get("name") == name]


def _events(path: Path) -> list[dict[str, Any]]:
    trace = json.loads(path.read_text())
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def _numbers(report: dict[str, Any]) -> dict[str, float]:
    return {key: float(value) for key, value in report.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}
