"""``--mux priority`` on CPU through the fake GPU (:class:`~deeppool.device.fake.FakeGpu`), which checks its
stream order, with the drill of :mod:`deeppool.multiplex.drill`; on a machine with a GPU the same drill
also runs on the real one (marked ``gpu``)."""

from __future__ import annotations

import math

import pytest
import torch

from deeppool.device.cuda import CudaGpu
from deeppool.device.fake import PRIORITIES, FakeGpu, FakeStream
from deeppool.errors import DeeppoolError
from deeppool.multiplex.config import BackgroundConfig, MuxMode
from deeppool.multiplex.drill import priority_drill, violations
from deeppool.multiplex.gpu import StreamBackground
from tests.multiplex.plans import BACKGROUND

CPU = torch.device("cpu")
WINDOWS = 12


@pytest.mark.slow
def test_priority_background_runs_only_in_windows_and_reports_losses_and_drops() -> None:
    gpu = FakeGpu()
    drill = priority_drill(gpu, CPU, BACKGROUND, windows=WINDOWS)
    result = drill.result
    assert result.error is None, result.error
    streams = [s for s in gpu.streams if s.name not in ("default", "collectives")]
    foreground, background = sorted(streams, key=lambda s: s.priority)  # higher priority: lower number
    assert foreground.priority < background.priority
    pieces = [(i.start_s or 0.0, i.end_s or 0.0) for i in gpu.log if i.stream is background and i.label == "replay"]
    in_windows = [p for p in pieces if p[0] > drill.windows[0][0]]  # after the first (capture) window
    assert len(in_windows) >= WINDOWS, "the background ran too little to test anything"
    assert violations(in_windows, drill) == []
    assert result.steps >= 2 and len(result.losses) == result.steps and all(math.isfinite(v) for v in result.losses)
    assert result.losses[-1] < result.losses[0], "replaying the captured step does not train the background"
    assert result.dropped_tokens >= drill.late
    assert result.dropped_tokens == sum(1 for _, busy in result.windows if busy == 0)
    assert result.busy_s > 0 and result.tokens == WINDOWS + drill.late + 1


def test_the_drill_names_pieces_outside_windows_and_during_all_reduces() -> None:
    from deeppool.multiplex.drill import Drill

    drill = Drill(result=None, windows=[(1.0, 2.0)], allreduces=[(0.5, 0.9)], late=0)  # type: ignore[arg-type]
    assert violations([(1.5, 1.6)], drill) == []
    assert violations([(0.6, 0.7)], drill) == ["a piece started at 0.600000 outside every window",
                                                "a piece started at 0.600000 during an all-reduce"]


@pytest.mark.slow
def test_a_missing_wait_in_the_background_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without its waits the background stream reads the model the default stream made: the fake refuses."""
    waits = FakeStream.wait_stream
    least, _ = PRIORITIES

    def background_never_waits(self: FakeStream, other: FakeStream) -> None:
        if self.priority != least or self.name in ("default", "collectives"):
            waits(self, other)

    monkeypatch.setattr(FakeStream, "wait_stream", background_never_waits)
    result = priority_drill(FakeGpu(), CPU, BACKGROUND, windows=2, late=0).result
    assert result.error is not None and result.error.startswith("StreamOrderError"), result.error
    assert "without waiting for it" in result.error


def test_priority_background_refused_without_a_gpu() -> None:
    with pytest.raises(DeeppoolError, match="--mux priority needs a CUDA GPU"):
        StreamBackground(BackgroundConfig(model=BACKGROUND, mode=MuxMode.PRIORITY), rank=1, device=CPU,
                         gpu=FakeGpu(gpus=0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_priority_background_trains_on_a_real_gpu() -> None:
    drill = priority_drill(CudaGpu(), torch.device("cuda", 0), BACKGROUND)
    assert drill.result.error is None and drill.result.busy_s > 0
    assert len(drill.result.losses) == drill.result.steps and drill.result.dropped_tokens >= drill.late
