"""The ``deeppool jobs`` table."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from rich.table import Table

from deeppool.coordinator.jobs import Job


def age(then: datetime, now: datetime | None = None) -> str:
    seconds = int(((now or datetime.now(UTC)) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def jobs_table(jobs: Sequence[Job], now: datetime | None = None) -> Table:
    table = Table(title=f"{len(jobs)} jobs")
    for column in ("id", "kind", "state", "GPUs", "progress", "age", "model"):
        table.add_column(column, justify="right" if column in ("id", "GPUs", "progress", "age") else "left")
    for job in jobs:
        table.add_row(str(job.id), job.kind.value, job.state.value, str(job.held), f"{100 * job.progress:.0f}%",
                      age(job.created_at, now), job.model)
    return table
