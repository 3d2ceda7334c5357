"""``GET /metrics``: the coordinator's state in Prometheus' text format (``prometheus_client``).

- ``deeppool_jobs{state, kind}``: jobs in each state (every state and kind listed, zeros included);
- ``deeppool_queue_length``: jobs waiting (PENDING);
- ``deeppool_gpus``: the cluster's GPUs; ``deeppool_gpus_busy``: GPUs a starting or running job holds
  (a foreground job its grant, a background job on a free GPU its one); ``deeppool_gpus_lent``: GPUs of
  foreground jobs whose idle windows a background job is running in (it holds none of its own).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from deeppool.coordinator.jobs import Job, JobKind, JobStatus

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LIVE = (JobStatus.STARTING, JobStatus.RUNNING)


def exposition(jobs: list[Job], gpus: int, counts: dict[tuple[JobStatus, JobKind], int] | None = None) -> bytes:
    """The metrics of ``jobs`` on a cluster of ``gpus``, as Prometheus scrapes them.

    ``counts``: jobs by state and kind (the database's counters, :meth:`Store.counts`), so that ``jobs`` need
    hold only the live ones; without it they are counted from ``jobs``.
    """
    if counts is None:
        counts = {(state, kind): sum(1 for job in jobs if job.state is state and job.kind is kind)
                  for state in JobStatus for kind in JobKind}
    registry = CollectorRegistry()
    by_state = Gauge("deeppool_jobs", "jobs by state and kind", ["state", "kind"], registry=registry)
    for state in JobStatus:
        for kind in JobKind:
            by_state.labels(state=state.value, kind=kind.value).set(counts.get((state, kind), 0))
    Gauge("deeppool_queue_length", "jobs waiting to start (PENDING)", registry=registry).set(
        sum(counts.get((JobStatus.PENDING, kind), 0) for kind in JobKind))
    live = [job for job in jobs if job.state in _LIVE]
    hosts = {job.host_id for job in live if job.kind is JobKind.BACKGROUND and job.host_id is not None}
    Gauge("deeppool_gpus", "GPUs of the cluster", registry=registry).set(gpus)
    Gauge("deeppool_gpus_busy", "GPUs held by starting or running jobs", registry=registry).set(
        sum(job.gpus for job in live if job.kind is JobKind.FOREGROUND or job.host_id is None))
    Gauge("deeppool_gpus_lent", "GPUs of foreground jobs whose idle windows run a background job",
          registry=registry).set(sum(job.gpus for job in live if job.id in hosts))
    return generate_latest(registry)
