"""A drill for ``--mux priority``: a foreground with all-reduces and idle windows, a background in them.

What the executor does around an idle window, in one process: compute on the foreground's
high-priority stream, an all-reduce, a wait for the device, then the window (the background's token)
and its close. Run through the fake GPU (:class:`~deeppool.device.fake.FakeGpu`) on CPU by the tests
and ``benchmarks/gpu.py --dry-run``; on a real GPU by ``benchmarks/gpu.py``. :func:`violations` names
every background piece that started outside a window or during an all-reduce.
"""

from __future__ import annotations

import datetime
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from deeppool.device.seam import Gpu
from deeppool.multiplex.config import PRIORITY_PIECE_MS, BackgroundConfig, MuxMode
from deeppool.multiplex.gpu import StreamBackground, foreground_stream
from deeppool.multiplex.metrics import RankBackground
from deeppool.multiplex.pieces import StepPieces

Interval = tuple[float, float]


@dataclass(frozen=True, kw_only=True)
class Drill:
    result: RankBackground
    windows: list[Interval]
    """Host times each window was open (admit to close)."""
    allreduces: list[Interval]
    """Host times of each foreground all-reduce, launch to completion."""
    late: int
    """Windows admitted after their deadline: nothing may run in them."""
    pieces: StepPieces | None = None
    """The background step's pieces, as captured (None when the capture failed)."""


def _group() -> dist.ProcessGroup:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=30))
    return dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=30))


def _first_piece(background: StreamBackground, timeout_s: float) -> None:
    """Lend one long window until the background has captured its graphs and run a piece in it."""
    background.admit(time.perf_counter() + timeout_s, 1e3 * timeout_s)
    until = time.perf_counter() + timeout_s
    while time.perf_counter() < until and background.result_error() is None and background.pieces_run() == 0:
        time.sleep(0.01)
    background.close(None)


def priority_drill(gpu: Gpu, device: torch.device, model: Path, *, windows: int = 12, late: int = 3,
                   window_s: float = 0.03, timeout_s: float = 120.0, piece_ms: float = PRIORITY_PIECE_MS) -> Drill:
    """``windows`` idle windows of ``window_s`` between all-reduces, then ``late`` windows already past."""
    background = StreamBackground(BackgroundConfig(model=model, mode=MuxMode.PRIORITY, piece_ms=piece_ms), rank=0,
                                  device=device, gpu=gpu)
    group = _group()
    opened_at, reduced = [], []
    with gpu.on(device):
        weights = torch.randn(128, 128, device=device)
        with foreground_stream(gpu, device):
            background.wait_ready(timeout_s)
            _first_piece(background, timeout_s)
            for index in range(windows + late):
                grads = weights @ weights
                began = time.perf_counter()
                gpu.collective(lambda grads=grads: group.allreduce([grads]), [grads]).wait()
                gpu.synchronize(device)  # the executor waits for the device where a window opens
                reduced.append((began, time.perf_counter()))
                opened = time.perf_counter()
                background.admit(opened - 1.0 if index >= windows else opened + window_s, 1e3 * window_s)
                time.sleep(window_s)
                background.close(1e3 * window_s)
                opened_at.append((opened, time.perf_counter()))
                weights = weights * 0.5 + grads * 1e-4
        result = background.stop(timeout_s)
    return Drill(result=result, windows=opened_at, allreduces=reduced, late=late, pieces=background.pieces)


def violations(pieces: list[Interval], drill: Drill) -> list[str]:
    """Each piece (host start, end) that started outside every window or inside an all-reduce."""
    found = []
    for start, _ in pieces:
        if not any(opened <= start <= closed for opened, closed in drill.windows):
            found.append(f"a piece started at {start:.6f} outside every window")
        if any(began <= start <= ended for began, ended in drill.allreduces):
            found.append(f"a piece started at {start:.6f} during an all-reduce")
    return found
