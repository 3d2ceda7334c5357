"""Interference on one GPU in ``mps`` mode, window by window: the foreground's slowdown, the background's efficiency.

Under ``--mux mps`` the background is another process, a client of a private MPS daemon with
``--mps-percentage`` of the SMs, and it runs freely: it is not admitted window by window, MPS shares the
device while both run. So the sweep measures it running beside the foreground's loop of
:mod:`deeppool.multiplex.windows` (a phase of products, a wait for the device, a window held idle), all under
the daemon (the foreground's device context, made after it started, is a client too, as a rank's is under
``--mux mps``; so the sweep needs a process that has not used the GPU yet): first the foreground alone at
every window length, then the background set going and the same loops run beside
it, then the foreground idle for ``calibrate_s`` while the background runs alone. The background's pieces
are whole steps, each ended by a host read of its loss, and the child times them (their spans, on the
monotonic clock every process of the host shares); its *progress* in an interval is the steps done in it
(a step across an edge counted by the share of it inside), in seconds of it running alone (its median step
while the foreground idled). Then, for each window length:

* the foreground's slowdown is its median phase beside the background over alone, less one;
* the background's efficiency is its progress during the loop over the loop's windows' time, at most 1
  (under MPS it also progresses during the foreground's phases, which the slowdown pays for).

Through the fake GPU on CPU (``--dry-run``) the client is a CPU process started under the fake's stand-in
MPS control (:func:`~deeppool.device.fake.fake_mps_control`): what runs is the process side (the daemon's
start and quit, the client's environment and percentage, its steps' spans read back and the figures made
from them), not MPS's partition of the SMs; the figures are then the CPU's cores shared.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from deeppool.device.mps import client_env
from deeppool.device.seam import Gpu
from deeppool.errors import DeeppoolError
from deeppool.multiplex.config import BackgroundConfig, MuxMode
from deeppool.multiplex.cpu import ProcessBackground, child_spec
from deeppool.multiplex.windows import WINDOWS_MS, Foreground, WindowFigures, held_phases

Interval = tuple[float, float]


def sweep_mps(gpu: Gpu, device: torch.device, background: Path, folder: Path,
              windows_ms: tuple[float, ...] = WINDOWS_MS, *, whole: bool = True, foreground: Foreground | None = None,
              percentage: int = 30, calibrate_s: float = 0.5, timeout_s: float = 120.0) -> list[WindowFigures]:
    """The figures for each of ``windows_ms`` (and one whole phase with ``whole``), in that order; the client's
    files (its spec, log and statistics) go to ``folder``."""
    if not windows_ms and not whole or any(w <= 0 for w in windows_ms):
        raise DeeppoolError("window lengths must be above 0 ms, and at least one is needed")
    if calibrate_s <= 0:
        raise DeeppoolError("the background's calibration must last above 0 s")
    shape = foreground or Foreground()
    config = BackgroundConfig(model=background, mode=MuxMode.MPS, mps_percentage=percentage)
    with gpu.mps_daemon(), gpu.on(device):  # the daemon first: the foreground's context is a client of it too
        weights = torch.randn(shape.size, shape.size, device=device) / shape.size ** 0.5
        lengths = [(w, False) for w in windows_ms]
        if whole:
            lengths.append((statistics.median(held_phases(gpu, device, weights, shape, None, 0.0)), True))
        alone = [held_phases(gpu, device, weights, shape, None, w) for w, _ in lengths]
        spec = child_spec(config, rank=0, stats=folder / "mps-background.stats.json",
                          device="cpu" if device.type == "cpu" else str(device))
        client = ProcessBackground(spec, rank=0, folder=folder, env=client_env(percentage))
        try:
            client.wait_ready(timeout_s)
            client.running(True)
            lent, intervals, quiet = _beside(gpu, device, weights, shape, [w for w, _ in lengths], calibrate_s)
        finally:
            result = client.stop(timeout_s)
    if result.error is not None or not client.ready:
        raise DeeppoolError(f"the mps background failed during the window sweep: {result.error or 'it never started'}"
                            f" (see {client.log_path})")
    step_s = alone_step_s(result.spans, quiet)
    return [WindowFigures(window_ms=window_ms, whole=is_whole, fg_alone_ms=statistics.median(before),
                          fg_lent_ms=statistics.median(beside), windows=shape.windows,
                          bg_busy_ms=1e3 * progress_s(result.spans, interval, step_s))
            for (window_ms, is_whole), before, beside, interval in zip(lengths, alone, lent, intervals, strict=True)]


def _beside(gpu: Gpu, device: torch.device, weights: torch.Tensor, shape: Foreground, lengths: list[float],
            calibrate_s: float) -> tuple[list[list[float]], list[Interval], Interval]:
    """The foreground's loops at each of ``lengths`` beside the running client, each one's interval, then the
    interval the foreground idled for ``calibrate_s``."""
    lent, intervals = [], []
    for window_ms in lengths:
        began = time.perf_counter()
        lent.append(held_phases(gpu, device, weights, shape, None, window_ms))
        intervals.append((began, time.perf_counter()))
    began = time.perf_counter()
    time.sleep(calibrate_s)
    return lent, intervals, (began, time.perf_counter())


def alone_step_s(spans: tuple[tuple[float, float], ...], quiet: Interval) -> float:
    """The background's median step while running alone: its steps wholly inside ``quiet`` (else those that
    overlap it)."""
    inside = [end - start for start, end in spans if start >= quiet[0] and end <= quiet[1] and end > start]
    overlapping = [end - start for start, end in spans if end > quiet[0] and start < quiet[1] and end > start]
    if not inside and not overlapping:
        raise DeeppoolError("the mps background ran no step while the foreground was idle: it is too slow to "
                            "measure in this calibration (a smaller --bg-batch, or a longer calibration)")
    return statistics.median(inside or overlapping)


def progress_s(spans: tuple[tuple[float, float], ...], interval: Interval, step_s: float) -> float:
    """The background's progress during ``interval``: the steps done in it (a step across an edge by the share
    of it inside), in seconds of ``step_s`` each."""
    low, high = interval
    done = sum(max(0.0, min(end, high) - max(start, low)) / (end - start) for start, end in spans if end > start)
    return done * step_s
