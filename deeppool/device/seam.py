"""The device seam: every CUDA-, NCCL- and MPS-specific call of deeppool goes through a :class:`Gpu`.

Two implementations satisfy it: :class:`deeppool.device.cuda.CudaGpu` over ``torch.cuda``, NCCL and
``nvidia-cuda-mps-control`` (the only code that names them), and :class:`deeppool.device.fake.FakeGpu`,
which runs the same calls on CPU tensors and checks the ordering rules a GPU would silently break
(a read before its producer's event, a wait never made). Code above the seam is handed a ``Gpu`` (or
``None`` on CPU, where there are no streams) and never asks which one it has.

The semantics both keep (CUDA's): work on a stream runs in issue order; a stream waits only on the
events and streams it was told to wait on; an event completes when the work issued on its stream
before it has completed; a graph replays the work captured into it, on the stream it is replayed on;
among ready work a stream of higher priority (a lower number, as CUDA counts) goes first; a
collective waits for the stream current at its launch, and waiting on its handle makes the stream
current at the wait wait for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch


class Event(Protocol):
    """A point in a stream's work, timed (``torch.cuda.Event(enable_timing=True)``)."""

    def record(self, stream: Any = None) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end: Any) -> float: ...


class Stream(Protocol):
    """An in-order queue of device work with a priority (lower runs first among ready work)."""

    priority: int

    def wait_stream(self, other: Any) -> None: ...

    def wait_event(self, event: Any) -> None: ...

    def synchronize(self) -> None: ...


class Graph(Protocol):
    """Captured device work; :meth:`replay` issues it again on the current stream."""

    def replay(self) -> None: ...


class Work(Protocol):
    """A launched collective's handle."""

    def wait(self) -> Any: ...


class Gpu(Protocol):
    """The whole device surface deeppool uses. ``backend`` is the collective backend for it."""

    backend: str

    def available(self) -> bool: ...

    def count(self) -> int: ...

    def bind(self, local_rank: int) -> torch.device:
        """Make GPU ``local_rank % count`` this process's device (the collective backend binds to it)."""
        ...

    def current(self) -> torch.device: ...

    def name(self, device: torch.device) -> str: ...

    def total_memory(self, device: torch.device) -> int: ...

    def free_memory(self, device: torch.device) -> int: ...

    def generator(self, device: torch.device) -> torch.Generator: ...

    def on(self, device: torch.device) -> AbstractContextManager[None]:
        """This thread works on ``device`` (a thread's first call)."""
        ...

    def priority_range(self) -> tuple[int, int]:
        """(least, greatest) stream priority; greatest is the lower number."""
        ...

    def stream(self, device: torch.device, priority: int = 0) -> Stream: ...

    def current_stream(self, device: torch.device) -> Stream: ...

    def use(self, stream: Stream) -> AbstractContextManager[None]: ...

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        """``tensor`` is used on ``stream``: its memory is not reused before that use completes."""
        ...

    def event(self) -> Event: ...

    def graph(self) -> Graph: ...

    def graph_pool(self) -> Any:
        """A memory pool graphs captured into it share (``torch.cuda.graph_pool_handle()``): safe while they are
        replayed one at a time in the order they were captured."""
        ...

    def capture(self, graph: Graph, stream: Stream, pool: Any = None) -> AbstractContextManager[None]:
        """Capture what this thread issues inside into ``graph``, on ``stream`` (into ``pool`` when given). Other
        threads may go on using the device meanwhile."""
        ...

    def synchronize(self, device: torch.device) -> None: ...

    def collective(self, launch: Callable[[], Work], tensors: Sequence[torch.Tensor]) -> Work:
        """Launch a collective over ``tensors`` (read and written) with the stream semantics above."""
        ...

    def mps_daemon(self) -> AbstractContextManager[Any]:
        """A private MPS control daemon around the processes started inside (:mod:`deeppool.device.mps`)."""
        ...


def side_stream(gpu: Gpu | None, device: torch.device) -> tuple[Gpu, Stream] | None:
    """A stream beside the compute stream (the gradient all-reduce's), none without a GPU."""
    return None if gpu is None else (gpu, gpu.stream(device))


def event_factory(gpu: Gpu | None) -> Callable[[], Event] | None:
    """Timed device events, none without a GPU (spans are then timed on the host)."""
    return None if gpu is None else gpu.event


def synchronizer(gpu: Gpu | None, device: torch.device) -> Callable[[], None]:
    """Waits for the device's work; nothing to wait for without a GPU."""
    if gpu is None:
        return lambda: None
    return lambda: gpu.synchronize(device)
