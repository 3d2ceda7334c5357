"""``--mux priority`` on CPU through the fake GPU (:class:`~deeppool.device.fake.FakeGpu`), which checks its
stream order; on a machine with a GPU the same test also runs on the real one (marked ``gpu``).

The foreground here is what the executor does around an idle window: compute on its high-priority
stream, an all-reduce, a wait for the device, then the window (the background's token) and its close.
"""

from __future__ import annotations

import datetime
import math
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from deeppool.device.cuda import CudaGpu
from deeppool.device.fake import PRIORITIES, FakeGpu, FakeStream
from deeppool.device.seam import Gpu
from deeppool.errors import DeeppoolError
from deeppool.multiplex.config import BackgroundConfig, MuxMode
from deeppool.multiplex.gpu import StreamBackground, foreground_stream
from deeppool.multiplex.metrics import RankBackground
from tests.multiplex.plans import BACKGROUND
from tests.net import free_port

CPU = torch.device("cpu")
WINDOW_S = 0.03
WINDOWS = 12
LATE = 3
"""Windows whose deadline has passed when they are admitted: nothing may run in them (dropped)."""


@dataclass(frozen=True)
class Run:
    result: RankBackground
    windows: list[tuple[float, float]]
    allreduces: list[tuple[float, float]]


def _group() -> dist.ProcessGroup:
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=30))
    return dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=30))


def _first_piece(gpu: Gpu, background: StreamBackground, timeout_s: float = 120.0) -> None:
    """Lend one long window until the background has captured its graphs and run a piece in it."""
    background.admit(time.perf_counter() + timeout_s, 1e3 * timeout_s)
    until = time.perf_counter() + timeout_s
    while background._result["windows"] == [] and time.perf_counter() < until:  # noqa: SLF001
        if background._result["error"] is not None or isinstance(gpu, CudaGpu):  # noqa: SLF001
            break
        if any(item.label == "replay" for item in getattr(gpu, "log", [])):
            break
        time.sleep(0.01)
    background.close(None)


def run_priority(gpu: Gpu, device: torch.device) -> Run:
    """A foreground with all-reduces and idle windows, and a ``priority`` background in the windows."""
    background = StreamBackground(BackgroundConfig(model=BACKGROUND, mode=MuxMode.PRIORITY), rank=0,
                                  device=device, gpu=gpu)
    group = _group()
    windows, allreduces = [], []
    with gpu.on(device):
        weights = torch.randn(128, 128, device=device)
        with foreground_stream(gpu, device):
            background.wait_ready(60.0)
            _first_piece(gpu, background)
            for index in range(WINDOWS + LATE):
                grads = weights @ weights
                began = time.perf_counter()
                gpu.collective(lambda grads=grads: group.allreduce([grads]), [grads]).wait()
                gpu.synchronize(device)  # the executor waits for the device where a window opens
                allreduces.append((began, time.perf_counter()))
                opened = time.perf_counter()
                late = index >= WINDOWS
                background.admit(opened - 1.0 if late else opened + WINDOW_S, 1e3 * WINDOW_S)
                time.sleep(WINDOW_S)
                background.close(1e3 * WINDOW_S)
                windows.append((opened, time.perf_counter()))
                weights = weights * 0.5 + grads * 1e-4
        result = background.stop(60.0)
    return Run(result, windows, allreduces)


def _pieces(gpu: FakeGpu, background_stream: FakeStream) -> list[tuple[float, float]]:
    return [(i.start_s or 0.0, i.end_s or 0.0) for i in gpu.log if i.stream is background_stream and i.label == "replay"]


@pytest.mark.slow
def test_priority_background_runs_only_in_windows_and_reports_losses_and_drops() -> None:
    gpu = FakeGpu()
    run = run_priority(gpu, CPU)
    result = run.result
    assert result.error is None, result.error
    streams = [s for s in gpu.streams if s.name not in ("default", "collectives")]
    foreground, background = sorted(streams, key=lambda s: s.priority)  # higher priority: lower number
    assert foreground.priority < background.priority
    pieces = _pieces(gpu, background)
    in_windows = [p for p in pieces if p[0] > run.windows[0][0]]  # after the first (capture) window
    assert len(in_windows) >= WINDOWS, "the background ran too little to test anything"
    for start, _ in in_windows:
        assert any(opened <= start <= closed for opened, closed in run.windows), f"a piece started at {start} outside windows"
        assert not any(began <= start <= ended for began, ended in run.allreduces), "a piece started during an all-reduce"
    assert result.steps >= 2 and len(result.losses) == result.steps and all(math.isfinite(v) for v in result.losses)
    assert result.losses[-1] < result.losses[0], "replaying the captured step does not train the background"
    assert result.dropped_tokens >= LATE
    assert result.dropped_tokens == sum(1 for _, busy in result.windows if busy == 0)
    assert result.busy_s > 0 and result.tokens == WINDOWS + LATE + 1


@pytest.mark.slow
def test_a_missing_wait_in_the_background_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without its waits the background stream reads the model the default stream made: the fake refuses."""
    waits = FakeStream.wait_stream
    least, _ = PRIORITIES

    def background_never_waits(self: FakeStream, other: FakeStream) -> None:
        if self.priority != least or self.name in ("default", "collectives"):
            waits(self, other)

    monkeypatch.setattr(FakeStream, "wait_stream", background_never_waits)
    result = run_priority(FakeGpu(), CPU).result
    assert result.error is not None and result.error.startswith("StreamOrderError"), result.error
    assert "without waiting for it" in result.error


def test_priority_background_refused_without_a_gpu() -> None:
    with pytest.raises(DeeppoolError, match="--mux priority needs a CUDA GPU"):
        StreamBackground(BackgroundConfig(model=BACKGROUND, mode=MuxMode.PRIORITY), rank=1, device=CPU,
                         gpu=FakeGpu(gpus=0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_priority_background_trains_on_a_real_gpu() -> None:
    run = run_priority(CudaGpu(), torch.device("cuda", 0))
    assert run.result.error is None and run.result.busy_s > 0
    assert len(run.result.losses) == run.result.steps and run.result.dropped_tokens >= LATE
