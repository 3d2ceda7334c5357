"""What the planner optimises (``deeppool plan --objective``)."""

from __future__ import annotations

import enum

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
