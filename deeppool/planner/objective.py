"""What the planner optimises (``deeppool plan --objective``)."""

from __future__ import annotations

import enum


class Objective(enum.Enum):
    """The iteration time; DeepPool's time + price · GPU-time; or the cluster's throughput (foreground
    share plus the background work the plan's idle windows hold, :mod:`deeppool.planner.throughput`)."""

    TIME = "time"
    TIME_AND_GPU_TIME = "time+gpu-time"
    CLUSTER = "cluster"
