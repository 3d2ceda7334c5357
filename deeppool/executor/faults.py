"""Fault injection for tests, from the ``DEEPPOOL_FAULT`` environment variable (as the coordinator's).

``slow-rank:R`` makes rank ``R`` compute at half speed: after each of its
forward and backward ops it waits as long again as the op took (``slow-rank:R:F``
waits ``F − 1`` times as long, so it runs at ``1/F`` speed). The wait is inside
the op's compute span, so the rank is measured as slow, and the other ranks
wait for it in communication, as they would for a slow GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from deeppool.errors import DeeppoolError

FAULT = "DEEPPOOL_FAULT"
SLOW_RANK = "slow-rank"

Handler = TypeVar("Handler", bound=Callable[..., None])


@dataclass(frozen=True, kw_only=True)
class Slowdown:
    """Rank ``rank`` computes ``factor`` times slower."""

    rank: int
    factor: float = 2.0

    def __post_init__(self) -> None:
        if self.rank < 0 or self.factor < 1:
            raise DeeppoolError(f"{FAULT}={SLOW_RANK}:{self.rank}:{self.factor}: give a rank >= 0 and a factor >= 1")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Slowdown | None:
        """The slowdown ``DEEPPOOL_FAULT`` asks for, or None (other faults are not the executor's)."""
        kind, _, rest = environ.get(FAULT, "").partition(":")
        if kind != SLOW_RANK:
            return None
        rank, _, factor = rest.partition(":")
        try:
            return cls(rank=int(rank), factor=float(factor) if factor else 2.0)
        except ValueError:
            raise DeeppoolError(f"{FAULT}={environ[FAULT]}: write {SLOW_RANK}:RANK or {SLOW_RANK}:RANK:FACTOR") from None

    def slowed(self, handler: Handler, synchronize: Callable[[], None]) -> Handler:
        """``handler`` followed by a wait of ``factor − 1`` times its own duration (device work included)."""

        def run(*args: object) -> None:
            start = time.perf_counter()
            handler(*args)
            synchronize()
            time.sleep((self.factor - 1) * (time.perf_counter() - start))

        return run  # type: ignore[return-value]
