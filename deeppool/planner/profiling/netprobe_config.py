"""What the network probe (:mod:`deeppool.planner.profiling.netprobe`) measures: ranks, message sizes,
repeats. Apart from the probe, which imports torch, so that ``deeppool profile-network`` checks its options
first."""

from __future__ import annotations

from dataclasses import dataclass

from deeppool.errors import DeeppoolError

DEFAULT_SIZES = (4 * 2**10, 64 * 2**10, 2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20)
"""Message sizes in bytes: 4 KiB to 64 MiB (a reshard of a few samples to a large gradient bucket)."""


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    """What to measure: ranks, message sizes (bytes), repeats, warm-up runs, timeout."""

    nproc: int = 2
    sizes: tuple[int, ...] = DEFAULT_SIZES
    repeats: int = 10
    """The fewest timed repeats of each pattern and size."""
    min_seconds: float = 0.4
    """Repeats go on until each pattern and size has taken about this long (at most ``max_repeats``): a
    collective on a shared host has a heavy tail (a few ms in one call of three), and what an iteration
    pays is its mean, which takes many repeats to see."""
    max_repeats: int = 200
    warmup: int = 3
    timeout_s: float = 120.0
    busy_ms: float = 10.0
    """How much the ranks of a group compute together (a fixed amount of work, this long on rank 0 alone)
    before they send to rank 0 or sum a tensor (a stage's compute, a backward's end)."""

    def __post_init__(self) -> None:
        if self.nproc < 2:
            raise DeeppoolError(f"--nproc {self.nproc}: measuring a network needs at least 2 processes")
        if not self.sizes or min(self.sizes) < 4:
            sizes = ",".join(map(str, self.sizes))
            raise DeeppoolError(f"--sizes {sizes}: every message size must be at least 4 bytes")
        if self.repeats < 1:
            raise DeeppoolError(f"--repeats {self.repeats} must be at least 1")
        if self.max_repeats < self.repeats or self.min_seconds < 0:
            raise DeeppoolError(f"the most repeats ({self.max_repeats}) must be >= --repeats ({self.repeats}) "
                                "and the time per size >= 0")
        if self.warmup < 0:
            raise DeeppoolError(f"--warmup {self.warmup} must be >= 0")
