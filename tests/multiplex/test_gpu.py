"""GPU modes: without CUDA they import and are refused; with CUDA, `priority` runs (marked gpu)."""

from __future__ import annotations

import pytest
import torch

from deeppool.errors import DeeppoolError
from deeppool.multiplex.config import BackgroundConfig, MuxMode
from tests.multiplex.plans import BACKGROUND


def test_gpu_modules_import_without_cuda() -> None:
    import deeppool.multiplex.gpu  # noqa: F401
    import deeppool.multiplex.mps  # noqa: F401


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_priority_background_refused_without_cuda() -> None:
    from deeppool.multiplex.gpu import StreamBackground

    with pytest.raises(DeeppoolError, match="--mux priority needs a CUDA GPU"):
        StreamBackground(BackgroundConfig(model=BACKGROUND, mode=MuxMode.PRIORITY), rank=1, device=torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_priority_background_trains_on_tokens() -> None:
    import time

    from deeppool.multiplex.gpu import StreamBackground

    bg = StreamBackground(BackgroundConfig(model=BACKGROUND, mode=MuxMode.PRIORITY), rank=1,
                          device=torch.device("cuda", 0))
    bg.wait_ready(60.0)
    time.sleep(5)
    for _ in range(50):
        bg.admit(time.perf_counter() + 0.005, 5.0)
        time.sleep(0.006)
        bg.close(6.0)
    result = bg.stop()
    assert result.error is None and result.busy_s > 0
    assert len(result.windows) == 50 and all(busy <= 6.0 for _, busy in result.windows)
