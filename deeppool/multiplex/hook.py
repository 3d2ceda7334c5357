"""The executor's thin hook: a listener for a rank, stopped after training, and the report on rank 0.

    mux = Multiplexer.start(plan, background, rank=rank, out_dir=out, device=device)
    try:
        result = train_rank(plan, ..., on_idle=mux.listener)
    finally:
        mux.stop()
    sections = mux.gather(comm, result.spans)   # every rank; {"multiplex": ...} on rank 0
    mux.show(console)                           # rank 0: the table

It is the executor's :class:`~deeppool.executor.engine.idle.IdleLender`: the command that starts the ranks hands the
worker :meth:`Multiplexer.start` (with the ``BackgroundConfig`` bound), and the worker knows no more than that.

A rank the plan never leaves idle hosts nothing (its listener is never called). A rank that runs no
layer of the plan hosts a background like any other: its one window is the whole iteration (it opens
as the rank's iteration starts and closes when rank 0's ends, ``EngineParts.pace``).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from deeppool.device.cuda import gpu_for
from deeppool.device.seam import Gpu
from deeppool.executor.engine.comm import Comm
from deeppool.executor.engine.idle import IdleListener, NoBackground
from deeppool.executor.engine.timing import Span
from deeppool.multiplex.config import BackgroundConfig, MuxMode
from deeppool.multiplex.cpu import ProcessBackground, child_spec
from deeppool.multiplex.metrics import MultiplexReport, RankBackground, RankSteps, report
from deeppool.multiplex.report import print_report
from deeppool.multiplex.session import Background, Session
from deeppool.plans import Plan
from deeppool.planner.profiling.interference import idle_throughout


class Multiplexer:
    def __init__(self, plan: Plan, config: BackgroundConfig, rank: int, session: Session | None,
                 device: torch.device, gpu: Gpu | None) -> None:
        self.plan, self.config, self.rank, self.session, self.device = plan, config, rank, session, device
        self.gpu = gpu
        self.background: RankBackground | None = None
        self.report: MultiplexReport | None = None

    @classmethod
    def start(cls, plan: Plan, config: BackgroundConfig, *, rank: int, out_dir: Path | None,
              device: torch.device, gpu: Gpu | None = None) -> Multiplexer:
        """``gpu``: the device seam (the real GPU of a CUDA ``device`` when not given; a fake in tests)."""
        gpu = gpu if gpu is not None else gpu_for(device)
        windows = tuple(w.length_ms for w in plan.idle_windows(rank))
        if not any(length > 0 for length in windows):
            return cls(plan, config, rank, None, device, gpu)
        folder = (out_dir or Path(tempfile.mkdtemp(prefix="deeppool-bg-"))) / "background"
        background = _background(config, rank=rank, folder=folder, device=device, gpu=gpu)
        session = Session(config, background, predicted_iteration_ms=plan.predicted.iteration_ms,
                          idle_throughout=idle_throughout(windows, plan.predicted.iteration_ms))
        return cls(plan, config, rank, session, device, gpu)

    def foreground(self) -> contextlib.AbstractContextManager[None]:
        """Where the foreground runs: a high-priority stream in ``--mux priority``."""
        if self.session is not None and self.config.mode is MuxMode.PRIORITY and self.gpu is not None:
            from deeppool.multiplex.gpu import foreground_stream

            return foreground_stream(self.gpu, self.device)
        return contextlib.nullcontext()

    @property
    def listener(self) -> IdleListener:
        """What the executor calls as windows open and close: the session, or nothing on a rank never idle."""
        return self.session if self.session is not None else NoBackground()

    def stop(self) -> RankBackground | None:
        if self.session is not None and self.background is None:
            self.background = self.session.stop()
        return self.background

    def trace_spans(self) -> list[Span]:
        return self.background.trace_spans() if self.background is not None else []

    def gather(self, comm: Comm, spans: Iterable[Span]) -> dict[str, Any]:
        """Every rank's steps and background on rank 0: its report, as ``summary.json``'s ``multiplex``."""
        gathered = comm.gather(RankSteps.of(self.rank, spans, self.stop()))
        if gathered is None:
            return {}
        planned = sum(w.length_ms for w in self.plan.predicted.idle_windows)
        self.report = report(self.config.mode, self.config.schedule, list(gathered), planned_idle_ms=planned)
        return {"multiplex": self.report.to_json()}

    def show(self, console: Console) -> None:
        """Rank 0: the report :meth:`gather` made (nothing on the other ranks)."""
        if self.report is not None:
            print_report(self.report, console)


def _background(config: BackgroundConfig, *, rank: int, folder: Path, device: torch.device,
                gpu: Gpu | None) -> Background:
    if config.mode is MuxMode.PRIORITY:
        from deeppool.multiplex.gpu import StreamBackground

        return StreamBackground(config, rank=rank, device=device, gpu=gpu)
    if config.broker is not None:  # a guest of another account: its process is the host supervisor's to start
        from deeppool.multiplex.remote import BrokeredChild

        broker, request = config.broker, {"op": "child", "rank": rank}
        spec = {**child_spec(config, rank=rank, stats=folder / "unused"), "stats": None}
        return ProcessBackground(spec, rank=rank, folder=folder,
                                 spawn=lambda *args, **kwargs: BrokeredChild.start(broker, request))
    env = None
    if config.mode is MuxMode.MPS:
        from deeppool.device.mps import client_env

        env = client_env(config.mps_percentage)
    spec = child_spec(config, rank=rank, stats=folder / f"background-rank{rank}.stats.json",
                      device=str(device) if config.mode is MuxMode.MPS else "cpu")
    return ProcessBackground(spec, rank=rank, folder=folder, env=env)
