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
    first touch, so a layer's first batch would time page faults and a
    training rank would re-fault its activations every iteration. With these
    thresholds tensors below 32 MiB come from the heap and the heap is never
    trimmed; the warm-up runs absorb the first faults
    (``docs/notes/0013-keep-freed-memory-on-cpu.md``).
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
    libc.mallopt(_M_TRIM_THRESHOLD, 2**30)
