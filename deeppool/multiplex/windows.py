"""Interference on one GPU, window by window: the foreground's slowdown and the background's efficiency.

A foreground that runs layers and then holds an idle window, as a rank of a plan does: a *phase* of
``matmuls`` products on its high-priority stream, a wait for the device (the executor waits where a window
opens), then a window of ``window_ms`` in which the ``priority`` background (:class:`StreamBackground`:
CUDA-graph pieces on the low-priority stream, one in flight) is admitted, and its close. For each window
length the same loop runs first with no window lent (the foreground alone), then lent:

* the foreground's slowdown is its median phase time lent over alone, less one (a piece still running when
  the window closes shares the device with the next phase);
* the background's efficiency is its pieces' device time over the windows' time (at most 1).

``whole`` adds a window as long as one alone phase: a rank idle for a whole iteration of the plan. The
result is ``interference.json`` as ``deeppool simulate --interference`` and ``deeppool plan --objective
cluster`` read it (:meth:`~deeppool.planner.profiling.interference.InterferenceModel.measured`): the
efficiency by window length (each length the lower edge of its bin) and the worst slowdown of the windows
the background was lent (``mps`` mode, a background process beside the foreground: :mod:`deeppool.multiplex.mps_windows`;
a real plan's natural windows: :mod:`deeppool.multiplex.natural`). Run through the fake GPU on CPU by the tests and ``benchmarks/gpu.py --dry-run``
(its figures then are not a GPU's); on a GPU by ``deeppool multiplex windows`` and ``benchmarks/gpu.py``.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deeppool.device.seam import Gpu
from deeppool.errors import DeeppoolError
from deeppool.multiplex.config import PRIORITY_PIECE_MS, BackgroundConfig, MuxMode
from deeppool.multiplex.gpu import StreamBackground, foreground_stream

WINDOWS_MS = (0.5, 1.0, 2.0, 5.0, 20.0)
"""The window lengths measured by default, with ``whole`` (one foreground phase)."""


@dataclass(frozen=True, kw_only=True)
class WindowFigures:
    """One window length's figures (ms)."""

    window_ms: float
    whole: bool
    fg_alone_ms: float
    fg_lent_ms: float
    bg_busy_ms: float
    windows: int

    @property
    def slowdown(self) -> float:
        """The foreground's phase lent over alone, less one (negative: within noise)."""
        return self.fg_lent_ms / self.fg_alone_ms - 1 if self.fg_alone_ms > 0 else 0.0

    @property
    def delay_ms(self) -> float:
        """The foreground's phase lent less alone: what a window's background costs the work after it."""
        return self.fg_lent_ms - self.fg_alone_ms

    @property
    def efficiency(self) -> float:
        """The share of the windows' time the background's pieces ran."""
        return min(1.0, self.bg_busy_ms / (self.windows * self.window_ms)) if self.windows and self.window_ms else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"window_ms": self.window_ms, "whole": self.whole, "fg_alone_ms": self.fg_alone_ms,
                "fg_lent_ms": self.fg_lent_ms, "bg_busy_ms": self.bg_busy_ms, "windows": self.windows,
                "slowdown": self.slowdown, "delay_ms": self.delay_ms, "efficiency": self.efficiency}


@dataclass(frozen=True, kw_only=True)
class Foreground:
    """The foreground's phase: ``matmuls`` products of ``size`` × ``size`` on the high-priority stream (by
    default about 5 ms on an H200 in fp32: a slowdown is relative to a phase of that length, and
    :attr:`WindowFigures.delay_ms` is the same in ms)."""

    matmuls: int = 16
    size: int = 2048
    windows: int = 20
    """Windows per length (and alone phases before them)."""

    def __post_init__(self) -> None:
        if min(self.matmuls, self.size, self.windows) < 1:
            raise DeeppoolError("the foreground needs at least one product, one row and one window")


def sweep(gpu: Gpu, device: torch.device, background: Path, windows_ms: tuple[float, ...] = WINDOWS_MS, *,
          whole: bool = True, foreground: Foreground | None = None, piece_ms: float = PRIORITY_PIECE_MS,
          timeout_s: float = 120.0) -> list[WindowFigures]:
    """The figures for each of ``windows_ms`` (and one whole phase with ``whole``), in that order."""
    if not windows_ms and not whole or any(w <= 0 for w in windows_ms):
        raise DeeppoolError("window lengths must be above 0 ms, and at least one is needed")
    shape = foreground or Foreground()
    lent = StreamBackground(BackgroundConfig(model=background, mode=MuxMode.PRIORITY, piece_ms=piece_ms), rank=0,
                            device=device, gpu=gpu)
    found = []
    with gpu.on(device):
        weights = torch.randn(shape.size, shape.size, device=device) / shape.size ** 0.5
        with foreground_stream(gpu, device):
            lent.wait_ready(timeout_s)
            first_piece(lent, timeout_s)
            for window_ms in windows_ms:
                found.append(_one_length(gpu, device, lent, weights, shape, window_ms, whole=False))
            if whole:
                alone = statistics.median(held_phases(gpu, device, weights, shape, None, 0.0))
                found.append(_one_length(gpu, device, lent, weights, shape, alone, whole=True))
        result = lent.stop(timeout_s)
    if result.error is not None:
        raise DeeppoolError(f"the background failed during the window sweep: {result.error}")
    return found


def first_piece(background: StreamBackground, timeout_s: float) -> None:
    """Lend one long window until the background has captured its graphs and run a piece in it."""
    background.admit(time.perf_counter() + timeout_s, 1e3 * timeout_s)
    until = time.perf_counter() + timeout_s
    while time.perf_counter() < until and background.result_error() is None and background.pieces_run() == 0:
        time.sleep(0.01)
    background.close(None)
    wait_served(background, 1, timeout_s)


def wait_served(background: StreamBackground, windows: int, timeout_s: float) -> None:
    """Wait until the background has finished serving ``windows`` windows in all (its busy time is then in)."""
    until = time.perf_counter() + timeout_s
    while background.served() < windows and background.result_error() is None and time.perf_counter() < until:
        time.sleep(0.001)


def _one_length(gpu: Gpu, device: torch.device, background: StreamBackground, weights: torch.Tensor,
                shape: Foreground, window_ms: float, *, whole: bool) -> WindowFigures:
    alone = held_phases(gpu, device, weights, shape, None, window_ms)
    busy_before, served_before = background.busy_s(), background.served()
    lent = held_phases(gpu, device, weights, shape, background, window_ms)
    wait_served(background, served_before + shape.windows, 10.0)
    return WindowFigures(window_ms=window_ms, whole=whole, fg_alone_ms=statistics.median(alone),
                         fg_lent_ms=statistics.median(lent), bg_busy_ms=1e3 * (background.busy_s() - busy_before),
                         windows=shape.windows)


def held_phases(gpu: Gpu, device: torch.device, weights: torch.Tensor, shape: Foreground,
            background: StreamBackground | None, window_ms: float) -> list[float]:
    """``shape.windows`` phases, each followed by a window (lent to ``background`` when given, else held
    idle); each phase's ms from its issue until the device finished it."""
    times = []
    for _ in range(shape.windows):
        began = time.perf_counter()
        value = weights
        for _ in range(shape.matmuls):
            value = value @ weights
        gpu.synchronize(device)  # the executor waits for the device where a window opens
        times.append(1e3 * (time.perf_counter() - began))
        opened = time.perf_counter()
        if background is not None:
            background.admit(opened + window_ms / 1e3, window_ms)
        while time.perf_counter() - opened < window_ms / 1e3:
            time.sleep(min(window_ms / 1e3 / 4, 0.001))
        if background is not None:
            background.close(window_ms)
    return times


def interference_json(found: list[WindowFigures], *, piece_ms: float = PRIORITY_PIECE_MS, dry_run: bool = False,
                      mode: MuxMode = MuxMode.PRIORITY) -> dict[str, Any]:
    """``interference.json`` from a sweep in ``mode`` (``priority``, or ``mps``: :mod:`deeppool.multiplex.mps_windows`):
    efficiency by window length, the worst slowdown where lent."""
    curve: dict[float, float] = {}
    for figures in sorted(found, key=lambda f: f.window_ms):
        curve[round(figures.window_ms, 4)] = round(figures.efficiency, 4)
    return {
        "mode": mode.value,
        **({"piece_ms": piece_ms} if mode is MuxMode.PRIORITY else {}),
        "fg_slowdown": 1 + max(0.0, *(f.slowdown for f in found)),
        "bg_efficiency": max(1e-3, statistics.fmean(f.efficiency for f in found)),
        "efficiency_by_window_ms": [{"window_ms": w, "efficiency": e} for w, e in curve.items()],
        "windows": [f.to_json() for f in found],
        "source": f"deeppool multiplex windows (one GPU, {mode.value} mode)" + (" DRY RUN through the fake GPU"
                                                                                if dry_run else ""),
    }


def write(found: list[WindowFigures], out: Path, *, piece_ms: float = PRIORITY_PIECE_MS, dry_run: bool = False,
          mode: MuxMode = MuxMode.PRIORITY, natural: list[dict[str, Any]] | None = None) -> Path:
    """``OUT/interference.json`` of the sweep; ``natural``: a one-rank plan's natural windows, under
    ``natural_windows`` (:mod:`deeppool.multiplex.natural`)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "interference.json"
    data = interference_json(found, piece_ms=piece_ms, dry_run=dry_run, mode=mode)
    if natural is not None:
        data["natural_windows"] = natural
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
