"""What the planner optimises (``deeppool plan --objective``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from deeppool.errors import DeeppoolError

DEFAULT_CLUSTER_GAP = 2e-3
"""``--cluster-gap``'s default: the cluster objective's plan is proven best to within 0.2% of the cluster's
throughput, below the cost model's precision; at 0 the search costs, one ILP solve each, the many plans that
differ from the best in one small layer by less than that."""


class Objective(enum.Enum):
    """The iteration time; DeepPool's time + price · GPU-time; or the cluster's throughput (foreground
    share plus the background work the plan's idle windows hold, :mod:`deeppool.planner.throughput`)."""

    TIME = "time"
    TIME_AND_GPU_TIME = "time+gpu-time"
    CLUSTER = "cluster"


@dataclass(frozen=True, kw_only=True)
class WorkCap:
    """A search bounded by work instead of the clock: it stops before a step once ``solves`` ILP solves are
    done, and each solve's branch and bound stops after ``nodes`` nodes. Nothing then depends on the machine's
    load, so the same problem gives the same plan and the same bound anywhere (the simulator's searches)."""

    solves: int
    nodes: int

    def __post_init__(self) -> None:
        if self.solves < 1 or self.nodes < 1:
            raise DeeppoolError(f"a search's work cap needs at least 1 solve and 1 node, not {self.solves} and "
                                f"{self.nodes}")
