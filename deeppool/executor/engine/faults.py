"""Fault injection for tests, from the ``DEEPPOOL_FAULT`` environment variable (as the coordinator's).

``slow-rank:R`` makes rank ``R`` compute at half speed: after each of its
forward and backward ops it keeps working (spinning on ``clock``) as long again
as the op took (``slow-rank:R:F``: ``F − 1`` times as long, so it runs at
``1/F`` speed). On CPU the clock is the thread's CPU time, so the extra is real
work, measured as the rank's compute like the op's own; on a GPU it is the
wall clock. The extra is inside the op's compute span, so the rank is measured
as slow, and the other ranks wait for it in communication, as they would for
a slow GPU. (An op that itself waits inside, SyncBatchNorm's reductions, is
slowed by its whole duration on a GPU; on CPU, waiting uses no CPU time.)
"""

from __future__ import annotations

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

    def slowed(self, handler: Handler, synchronize: Callable[[], None], clock: Callable[[], float]) -> Handler:
        """``handler`` followed by ``factor − 1`` times its own time on ``clock`` of spinning."""

        def run(*args: object) -> None:
            start = clock()
            handler(*args)
            synchronize()
            until = clock() + (self.factor - 1) * (clock() - start)
            while clock() < until:
                pass

        return run  # type: ignore[return-value]
