"""``GET /metrics``: the coordinator's state in Prometheus' text format (``prometheus_client``).

- ``deeppool_jobs{state, kind}``: jobs in each state (every state and kind listed, zeros included);
- ``deeppool_queue_length``: jobs waiting (PENDING);
- ``deeppool_gpus``: the cluster's GPUs; ``deeppool_gpus_busy``: GPUs a starting or running job holds
  (a foreground job its grant, a background job on a free GPU its one); ``deeppool_gpus_lent``: GPUs of
  foreground jobs whose idle windows a background job is running in (it holds none of its own);
- ``deeppool_job_gpus{job}``: the GPUs each live job holds now (a resize changes it);
  ``deeppool_job_guests{job}``: the guests each live foreground job hosts;
- ``deeppool_resizes{phase}``: resizes of running jobs by phase (:mod:`deeppool.coordinator.elastic`);
  ``deeppool_resize_last_seconds{part}``: what the last finished one cost (checkpoint, stop, plan, restart);
- ``deeppool_job_iteration_seconds{job, gpus, batch}``: each live job's measured speed model (its median
  iteration on that many GPUs at that batch), and ``deeppool_job_noise_scale{job}`` its gradient noise scale.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from deeppool.coordinator.jobs import Job, JobKind, JobStatus, SpeedPoint, WidthChange

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LIVE = (JobStatus.STARTING, JobStatus.RUNNING)


def exposition(jobs: list[Job], gpus: int, counts: dict[tuple[JobStatus, JobKind], int] | None = None, *,
               resizes: Mapping[str, int] | None = None, last_resize: WidthChange | None = None,
               speeds: Mapping[int, Sequence[SpeedPoint]] | None = None) -> bytes:
    """The metrics of ``jobs`` on a cluster of ``gpus``, as Prometheus scrapes them.

    ``counts``: jobs by state and kind (the database's counters, :meth:`Store.counts`), so that ``jobs`` need
    hold only the live ones; without it they are counted from ``jobs``. ``resizes``: resizes by phase;
    ``last_resize``: the last one that finished; ``speeds``: the live jobs' measured speeds.
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
        sum(job.held for job in live if job.kind is JobKind.FOREGROUND or job.host_id is None))
    Gauge("deeppool_gpus_lent", "GPUs of foreground jobs whose idle windows run a background job",
          registry=registry).set(sum(job.held for job in live if job.id in hosts))
    _elastic(registry, live, resizes or {}, last_resize, speeds or {})
    return generate_latest(registry)


def _elastic(registry: CollectorRegistry, live: list[Job], resizes: Mapping[str, int], last: WidthChange | None,
             speeds: Mapping[int, Sequence[SpeedPoint]]) -> None:
    width = Gauge("deeppool_job_gpus", "GPUs each live job holds now", ["job"], registry=registry)
    guests = Gauge("deeppool_job_guests", "guests each live foreground job hosts", ["job"], registry=registry)
    for job in live:
        if job.host_id is None:
            width.labels(job=str(job.id)).set(job.held)
        if job.kind is JobKind.FOREGROUND:
            guests.labels(job=str(job.id)).set(sum(1 for other in live if other.host_id == job.id))
    by_phase = Gauge("deeppool_resizes", "resizes of running jobs by phase", ["phase"], registry=registry)
    for phase, number in resizes.items():
        by_phase.labels(phase=phase).set(number)
    cost = Gauge("deeppool_resize_last_seconds", "what the last finished resize cost, by part", ["part"],
                 registry=registry)
    if last is not None:
        for part, seconds in (("checkpoint", last.checkpoint_s), ("stop", last.stop_s), ("plan", last.plan_s),
                              ("restart", last.restart_s)):
            if seconds is not None:
                cost.labels(part=part).set(seconds)
    iteration = Gauge("deeppool_job_iteration_seconds", "each live job's measured iteration time",
                      ["job", "gpus", "batch"], registry=registry)
    noise = Gauge("deeppool_job_noise_scale", "each live job's measured gradient noise scale (samples)", ["job"],
                  registry=registry)
    for job_id, points in speeds.items():
        for point in points:
            iteration.labels(job=str(job_id), gpus=str(point.gpus), batch=str(point.batch)).set(point.iteration_s)
        measured = [point.gns for point in points if point.gns is not None]
        if measured:
            noise.labels(job=str(job_id)).set(measured[-1])
