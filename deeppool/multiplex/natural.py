"""Interference in a real one-rank plan's natural windows: its data loading and its optimizer step.

A plan on one GPU names no idle window, yet its device idles in every iteration: while the host makes the
next batch and moves it to the device, and while the host issues the optimizer's update, one small kernel
per parameter tensor. The plan's iteration runs as its one stage runs it (:class:`OneRankIteration`): the
model's data for the plan's batch, made and moved to the device (the *data-loading* window); the forward,
the loss and one backward; a read of the loss (the wait for the device); the plan's optimizer's step and
a wait for it (the *optimizer-step* window). The iteration runs on the foreground's high-priority stream,
first alone, then with the ``priority`` background (:class:`~deeppool.multiplex.gpu.StreamBackground`)
lent one kind of window at a time, admitted as the window opens, for as long as that window lasted alone,
and closed as it ends. For each kind:

* the foreground's slowdown is its median iteration lent over alone, less one;
* the background's efficiency is its pieces' device time over the windows' time (at most 1).

Run through the fake GPU on CPU by the tests and ``benchmarks/gpu.py --dry-run`` (its figures then are not
a GPU's); on a GPU by ``deeppool multiplex windows --plan`` and ``benchmarks/gpu.py``.
"""

from __future__ import annotations

import contextlib
import enum
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from deeppool.device.seam import Gpu
from deeppool.errors import DeeppoolError
from deeppool.executor.config import OptimizerConfig
from deeppool.model.loading import LoadedModel, load_model
from deeppool.multiplex.config import PRIORITY_PIECE_MS, BackgroundConfig, MuxMode
from deeppool.multiplex.gpu import StreamBackground, foreground_stream
from deeppool.multiplex.windows import WindowFigures, first_piece, wait_served
from deeppool.plans import Plan


class Natural(enum.Enum):
    """A window a one-rank iteration opens by itself."""

    DATA = "data loading"
    STEP = "optimizer step"


Lend = Callable[[Natural], AbstractContextManager[None]]


@dataclass(frozen=True, kw_only=True)
class NaturalFigures:
    """One kind of natural window's figures: ``figures.window_ms`` its median length alone, ``fg_*`` the
    iteration's."""

    window: Natural
    figures: WindowFigures

    def to_json(self) -> dict[str, Any]:
        return {"window": self.window.value, **self.figures.to_json()}


class OneRankIteration:
    """A one-rank plan's training iteration, as its one stage runs it (the module's docstring)."""

    def __init__(self, plan: Plan, device: torch.device) -> None:
        if plan.gpus != 1:
            raise DeeppoolError(f"--plan: natural windows are measured on a one-rank plan; this one is for "
                                f"{plan.gpus} GPUs (plan it with --gpus 1)")
        self.loaded: LoadedModel = load_model(plan.model)
        self.module = self.loaded.module.to(device).train()
        self.optimizer = OptimizerConfig(kind=plan.optimizer.base).build(self.module.parameters())
        self.batch, self.device = plan.global_batch, device

    def run(self, gpu: Gpu, lend: Lend) -> tuple[float, dict[Natural, float]]:
        """One iteration, each natural window inside ``lend(kind)``: its ms, and each window's ms."""
        windows: dict[Natural, float] = {}
        began = time.perf_counter()
        with lend(Natural.DATA):
            named = pytree.tree_map(self._moved, self.loaded.named_inputs(self.batch))
            targets = self.loaded.targets(self.batch)
            targets = None if targets is None else targets.to(self.device)
        windows[Natural.DATA] = 1e3 * (time.perf_counter() - began)
        loss = self.loaded.loss(self.module(**named), targets)
        loss.backward()
        float(loss.detach())  # the iteration's wait for the device: the step's window opens on an idle device
        opened = time.perf_counter()
        with lend(Natural.STEP):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            gpu.synchronize(self.device)
        windows[Natural.STEP] = 1e3 * (time.perf_counter() - opened)
        return 1e3 * (time.perf_counter() - began), windows

    def _moved(self, value: object) -> object:
        return value.to(self.device) if isinstance(value, torch.Tensor) else value


def measure_natural(gpu: Gpu, device: torch.device, background: Path, plan: Plan, *, iterations: int = 20,
                    piece_ms: float = PRIORITY_PIECE_MS, timeout_s: float = 120.0) -> list[NaturalFigures]:
    """The figures of each kind of natural window of ``plan``'s iteration, ``iterations`` alone and as many
    lent per kind."""
    if iterations < 1:
        raise DeeppoolError("the natural windows need at least one iteration")
    lent = StreamBackground(BackgroundConfig(model=background, mode=MuxMode.PRIORITY, piece_ms=piece_ms), rank=0,
                            device=device, gpu=gpu)
    found = []
    with gpu.on(device):
        iteration = OneRankIteration(plan, device)
        with foreground_stream(gpu, device):
            lent.wait_ready(timeout_s)
            first_piece(lent, timeout_s)
            for _ in range(2):  # warm-up: the allocator, the optimizer's state
                iteration.run(gpu, _held)
            alone = [iteration.run(gpu, _held) for _ in range(iterations)]
            for kind in Natural:
                length = statistics.median(windows[kind] for _, windows in alone)
                busy_before, served_before = lent.busy_s(), lent.served()
                lending = _lender(lent, kind, length)
                beside = [iteration.run(gpu, lending)[0] for _ in range(iterations)]
                wait_served(lent, served_before + iterations, 10.0)
                found.append(NaturalFigures(window=kind, figures=WindowFigures(
                    window_ms=length, whole=False, fg_alone_ms=statistics.median(ms for ms, _ in alone),
                    fg_lent_ms=statistics.median(beside), bg_busy_ms=1e3 * (lent.busy_s() - busy_before),
                    windows=iterations)))
        result = lent.stop(timeout_s)
    if result.error is not None:
        raise DeeppoolError(f"the background failed in the natural windows: {result.error}")
    return found


@contextlib.contextmanager
def _held(kind: Natural) -> Iterator[None]:
    """A window not lent."""
    del kind
    yield


def _lender(background: StreamBackground, lent: Natural, window_ms: float) -> Lend:
    """Lends ``background`` the windows of kind ``lent``, each for ``window_ms`` from its opening."""

    @contextlib.contextmanager
    def lend(kind: Natural) -> Iterator[None]:
        if kind is not lent:
            yield
            return
        opened = time.perf_counter()
        background.admit(opened + window_ms / 1e3, window_ms)
        try:
            yield
        finally:
            background.close(1e3 * (time.perf_counter() - opened))

    return lend
