"""The real :class:`~deeppool.device.seam.Gpu`: ``torch.cuda``, NCCL and ``nvidia-cuda-mps-control``.

The only module of deeppool that calls ``torch.cuda`` or names NCCL (``tests/test_device_seam.py``
checks). Every method is one or two calls into torch: the semantics live in CUDA, and the fake
(:mod:`deeppool.device.fake`) models them for tests. On one GPU it has run the ``gpu`` tests and the
one-GPU checks of ``benchmarks/gpu.py`` (streams and priorities, CUDA events, graph capture and replay in
the ``priority`` drill, the CUDA RNG, a single-rank NCCL all-reduce); what needs two GPUs (NCCL across
ranks, the multiplexed runs, the MPS daemon) has not run on one. The runs and their files:
``docs/gpu.md``, ``docs/gpu-runs/``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from deeppool.device import GPU_BACKEND
from deeppool.device.mps import MpsDaemon
from deeppool.device.seam import Event, Graph, Stream, Work

BACKEND = GPU_BACKEND


class CudaGpu:
    backend = BACKEND

    def available(self) -> bool:
        return torch.cuda.is_available()

    def count(self) -> int:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def bind(self, local_rank: int) -> torch.device:
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    def current(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def name(self, device: torch.device) -> str:
        return torch.cuda.get_device_name(device)

    def total_memory(self, device: torch.device) -> int:
        return torch.cuda.get_device_properties(device).total_memory

    def free_memory(self, device: torch.device) -> int:
        return torch.cuda.mem_get_info(device)[0]

    def generator(self, device: torch.device) -> torch.Generator:
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]

    @contextlib.contextmanager
    def on(self, device: torch.device) -> Iterator[None]:
        torch.cuda.set_device(device)
        yield

    def priority_range(self) -> tuple[int, int]:
        return torch.cuda.Stream.priority_range()

    def stream(self, device: torch.device, priority: int = 0) -> Stream:
        return torch.cuda.Stream(device=device, priority=priority)

    def current_stream(self, device: torch.device) -> Stream:
        return torch.cuda.current_stream(device)

    def use(self, stream: Stream) -> contextlib.AbstractContextManager[None]:
        return torch.cuda.stream(stream)  # type: ignore[arg-type]

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        tensor.record_stream(stream)  # type: ignore[arg-type]

    def event(self) -> Event:
        return torch.cuda.Event(enable_timing=True)

    def graph(self) -> Graph:
        return torch.cuda.CUDAGraph()

    def graph_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    @contextlib.contextmanager
    def capture(self, graph: Graph, stream: Stream, pool: Any = None) -> Iterator[None]:
        """``torch.cuda.graph``'s two calls without its device-wide synchronize and ``empty_cache``: the capture runs
        on a thread beside a training foreground, which neither should stall nor lose its cached memory; and in
        ``thread_local`` mode, so that the foreground's own calls meanwhile are not errors of the capture."""
        with torch.cuda.stream(stream):  # type: ignore[arg-type]
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")  # type: ignore[attr-defined]
            try:
                yield
            finally:
                graph.capture_end()  # type: ignore[attr-defined]

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def collective(self, launch: Callable[[], Work], tensors: Sequence[torch.Tensor]) -> Work:
        del tensors  # NCCL orders its stream after the current one and ``wait`` makes the current one wait
        return launch()

    def mps_daemon(self) -> contextlib.AbstractContextManager[Any]:
        return MpsDaemon.running()


def gpu_for(device: torch.device) -> CudaGpu | None:
    """The real GPU for a CUDA ``device``; ``None`` on CPU (no streams, no events: host clocks)."""
    return CudaGpu() if device.type == "cuda" else None


def backend_is_gpu(backend: str) -> bool:
    """Is this ``torch.distributed`` backend name the GPU's collective backend?"""
    return backend == BACKEND
