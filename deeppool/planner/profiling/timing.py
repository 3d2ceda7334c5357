"""How the profiler times work: the timer (device events on a GPU, the host clock on a CPU), the host's reference
work (how fast the host is now), and the intra-op threads a block is timed with."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from deeppool.device.cuda import gpu_for
from deeppool.device.seam import Gpu


def reference_ms(repeats: int = 3) -> float:
    """The host's speed now: the median ms of a fixed piece of work on the calling thread's intra-op threads,
    some 256×256 matmuls and many small ops (the steps this profiler times are made of both)."""
    big, small, weight = torch.ones(256, 256), torch.ones(32, 64), torch.ones(64, 64)

    def work() -> None:
        for _ in range(16):
            torch.mm(big, big)
        for _ in range(300):
            torch.relu(torch.mm(small, weight) + 1.0)

    work()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


@contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` intra-op threads (unchanged for None), then restore them."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def timed(device: torch.device, work: Callable[[], object], gpu: Gpu | None = None) -> tuple[float, object]:
    """Milliseconds ``work`` takes: between two device events on a GPU (``gpu``: the seam, the real GPU
    of a CUDA ``device`` when not given), on the host clock on CPU."""
    gpu = gpu if gpu is not None else gpu_for(device)
    if gpu is not None:
        start, end = gpu.event(), gpu.event()
        start.record()
        result = work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end), result
    began = time.perf_counter()
    result = work()
    return 1e3 * (time.perf_counter() - began), result
