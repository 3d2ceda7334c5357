"""Device-timed spans: events per op, one wait per iteration (the GPU path, with fake events on CPU)."""

from __future__ import annotations

import pytest
import torch

from deeppool.executor.engine.timing import Category, Recorder

CPU = torch.device("cpu")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.waits = 0

    def __call__(self) -> float:
        return self.now


class FakeEvent:
    """A device event whose device time is the fake host clock at ``record``; waits are counted on the clock."""

    def __init__(self, clock: FakeClock) -> None:
        self._clock = clock
        self.at: float | None = None

    def record(self) -> None:
        self.at = self._clock.now

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None
        return 1e3 * (end.at - self.at)

    def synchronize(self) -> None:
        self._clock.waits += 1


def test_device_spans_wait_once_per_iteration_and_sit_on_the_host_clock() -> None:
    clock = FakeClock()
    recorder = Recorder(clock, events=lambda: FakeEvent(clock))
    recorder.begin()
    for label, length in [("forward:a..b", 0.010), ("backward:a..b", 0.020), ("allreduce:a..b", 0.005)]:
        with recorder.span(0, label, Category.COMPUTE):
            clock.now += length
    assert recorder.spans == [] and clock.waits == 0  # nothing is resolved (or waited for) per op
    recorder.settle()
    assert clock.waits == 1
    assert [s.label for s in recorder.spans] == ["forward:a..b", "backward:a..b", "allreduce:a..b"]
    assert [s.ms for s in recorder.spans] == pytest.approx([10.0, 20.0, 5.0])
    assert recorder.spans[0].start_s == pytest.approx(100.0) and recorder.spans[-1].end_s == pytest.approx(100.035)


def test_host_spans_need_no_settling() -> None:
    clock = FakeClock()
    recorder = Recorder(clock)
    recorder.begin()
    with recorder.span(3, "forward:x", Category.COMPUTE):
        clock.now += 0.5
    recorder.settle()
    assert len(recorder.spans) == 1 and recorder.spans[0].ms == pytest.approx(500.0)


ON_GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs a CUDA GPU")])


@pytest.mark.parametrize("kind", ["fake", ON_GPU])
def test_device_events_time_a_matmul_without_a_synchronize_per_span(kind: str) -> None:
    """On a GPU, and through the fake GPU on CPU (which refuses an event read before it completes)."""
    import time

    from deeppool.device.cuda import CudaGpu
    from deeppool.device.fake import FakeGpu

    gpu, device, size = (CudaGpu(), torch.device("cuda", 0), 2048) if kind == "cuda" else (FakeGpu(), CPU, 256)
    recorder = Recorder(time.perf_counter, events=gpu.event)
    with gpu.on(device):
        x = torch.randn(size, size, device=device)
        recorder.begin()
        with recorder.span(0, "forward:mm", Category.COMPUTE):
            for _ in range(10):
                x = x @ x / size
        recorder.settle()
    assert len(recorder.spans) == 1 and recorder.spans[0].ms > 0
