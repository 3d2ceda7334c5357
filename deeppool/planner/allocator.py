"""The CPU allocator settings under which layers are timed and trained."""

from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 * 2**20


def steady_allocator() -> None:
    """Keep freed CPU memory for reuse (glibc only): the profiler and the executor's ranks both set it.

    glibc maps a large tensor afresh on every allocation until its dynamic
    threshold adapts, and returns freed memory at the top of the heap once
    more than twice that threshold is free; each fresh page then faults on
    first touch. In a VM that made element-wise layers at the profiler's first
    batch 10-80x slower than at the next, and a training rank re-faulted its
    activations every iteration: the CNN benchmark's first stage spent 16.8 ms
    in its backward with glibc's defaults and 10.4 ms with these thresholds
    (tensors below 32 MiB from the heap, the heap never trimmed), 21% of its
    iteration. The warm-up runs absorb the faults.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
    libc.mallopt(_M_TRIM_THRESHOLD, 2**30)
