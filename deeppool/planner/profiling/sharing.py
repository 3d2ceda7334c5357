"""How ranks share a CPU host's cores: threads doing the same fixed work at once, against the same work alone
(:func:`measure_sharing`), at the rank counts a plan may use (:func:`sharing_counts`)."""

from __future__ import annotations

import os
import statistics
import threading
import time

import torch

from deeppool.planner.profiling.timing import intra_op_threads


def sharing_counts(ranks: int | None) -> tuple[int, ...]:
    """The rank counts whose core sharing is measured: powers of two from 2, and ``ranks`` itself,
    up to twice the cores (beyond, time-slicing is linear: :meth:`Profile.sharing` extrapolates)."""
    if not ranks or ranks < 2:
        return ()
    top = min(ranks, 2 * (os.cpu_count() or 1))
    return tuple(sorted({2**k for k in range(1, top.bit_length()) if 2**k <= top} | {top}))


def measure_sharing(counts: tuple[int, ...], threads: int, repeats: int = 5, matmuls: int = 250) -> dict[int, float]:
    """``sharing(g)`` for each ``g`` of ``counts``: the slowest of ``g·threads`` single-threaded workers
    doing the same fixed work at once over ``threads`` of them alone, measured in turns (alone, then
    together) so that other work on the host, which comes and goes, weighs on both alike; the median
    of ``repeats`` turns, so that one slow turn does not set the figure (``benchmarks/core_sharing.py``;
    ``docs/notes/0005-core-sharing.md``).

    Workers are threads of this process: a matmul with one intra-op thread runs on its caller with
    the GIL released, so they compete for the cores as ranks (processes) do."""
    with intra_op_threads(1):
        _concurrent_work(threads, matmuls)  # warm-up
        return {
            g: statistics.median(
                _concurrent_work(g * threads, matmuls) / _concurrent_work(threads, matmuls) for _ in range(repeats)
            )
            for g in counts
        }


def _concurrent_work(workers: int, matmuls: int) -> float:
    """Seconds until the last of ``workers`` threads has done ``matmuls`` 256×256 matmuls, all started together.

    Interrupted (Ctrl-C), it stops its threads and waits until each has finished before the interrupt goes on:
    a thread still in a matmul as the interpreter exits aborted the process (``terminate called without an
    active exception``) where the command should say ``interrupted`` and exit 130. It waits on events the
    threads set, since a ``join`` that Ctrl-C interrupted marks its thread stopped while it still runs
    (CPython 3.11)."""
    matrix = torch.randn(256, 256)
    start, stop = threading.Barrier(workers), threading.Event()
    done = [threading.Event() for _ in range(workers)]
    finished: list[float] = []

    def work(mine: threading.Event) -> None:
        try:
            torch.set_num_threads(1)  # OpenMP's thread count is per calling thread
            torch.mm(matrix, matrix)
            start.wait()
            began = time.perf_counter()
            for _ in range(matmuls):
                if stop.is_set():
                    return
                torch.mm(matrix, matrix)
            finished.append(time.perf_counter() - began)
        except threading.BrokenBarrierError:
            return
        finally:
            mine.set()

    pool = [threading.Thread(target=work, args=(event,)) for event in done]
    try:
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
    except BaseException:
        stop.set()
        start.abort()
        for thread, event in zip(pool, done, strict=True):
            if thread.ident is not None:
                event.wait()
        raise
    return max(finished)


def concurrent_ranks(device: torch.device, threads: int | None) -> int | None:
    """On a CPU, the ranks that fit the host's cores with the intra-op threads measured with."""
    if device.type != "cpu":
        return None
    return max(1, (os.cpu_count() or 1) // (threads or torch.get_num_threads()))
