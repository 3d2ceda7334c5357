"""Speed models learned live: what each running job measures, and the model a co-adaptive policy decides by.

A run appends one line per optimizer step to ``job-N/run/steps.jsonl`` (the
slowest rank's iteration time, the step's samples, rank 0's gradient noise
scale when it measures one: ``--monitor gns``); the file is new each attempt,
and an attempt runs on one (GPUs, batch). :func:`measured` turns it into one
:class:`~deeppool.coordinator.jobs.SpeedPoint`: the median iteration time
after the first :data:`WARMUP_LINES` steps (which include the start), and the
last noise scale. The coordinator keeps each job's points in the database.

:func:`speed_model` fits :class:`~deeppool.adaptation.goodput.IterationFit`
(the throughput model of :mod:`deeppool.adaptation.goodput`) to a job's
points and gives it to the policy as a
:class:`~deeppool.scheduling.contract.SpeedModel`: progress is counted in
steps at the batch the job asked for (its ``steps`` in all), one epoch; on
``g`` GPUs at global batch ``M`` it makes ``gain(M) / T(g, M)`` of them per
second, ``gain`` AdaScale's (:func:`~deeppool.adaptation.goodput.adascale_gain`)
for the measured noise scale. Batches tried: the asked batch, and, once a
noise scale is measured, 2, 4 and 8 times it. A job never measured is
assumed to scale linearly (one second a step on the GPUs it asked for); a
*rigid* job (one that cannot checkpoint: a script job) has a model whose
only GPU count is the one it asked for.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from deeppool.adaptation.goodput import IterationFit, adascale_gain
from deeppool.coordinator.jobs import Job, SpeedPoint

WARMUP_LINES = 3
"""The first steps of an attempt, left out of its speed (they include building the model and resuming)."""
BATCH_SCALES = (1, 2, 4, 8)
"""Multiples of the asked batch a job may be given, once its noise scale is measured."""


def measured(data: bytes, *, job_id: int, gpus: int, batch: int) -> SpeedPoint | None:
    """The speed an attempt's ``steps.jsonl`` shows (complete lines only), or None before a step past the
    warm-up; lines that are not a step's figures are skipped."""
    times, gns = [], None
    for line in data.decode(errors="replace").splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if not isinstance(record, dict):
            continue
        iteration, noise = record.get("iteration_ms"), record.get("gns")
        if _finite(iteration) and iteration > 0:
            times.append(iteration / 1e3)
        if _finite(noise) and noise >= 0:
            gns = float(noise)
    kept = times[WARMUP_LINES:]
    if not kept:
        return None
    return SpeedPoint(job_id=job_id, gpus=gpus, batch=batch, iteration_s=statistics.median(kept), steps=len(kept),
                      gns=gns)


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class LiveSpeed:
    """A job's :class:`~deeppool.scheduling.contract.SpeedModel` from its measured points (module docstring)."""

    steps: int
    base_batch: int
    fit: IterationFit
    noise_scale: float | None
    min_gpus: int
    max_gpus: int

    @property
    def total_progress(self) -> float:
        return float(self.steps)

    def progress_at(self, epoch: int) -> float:
        return 0.0 if epoch <= 0 else float(self.steps)

    def epoch_at(self, progress: float) -> int:
        del progress
        return 0

    def gain(self, batch: int) -> float:
        if batch == self.base_batch or self.noise_scale is None:
            return 1.0
        return adascale_gain(batch, base_batch=self.base_batch, noise_scale=self.noise_scale)

    def batches(self) -> tuple[int, ...]:
        scales = BATCH_SCALES if self.noise_scale is not None else (1,)
        return tuple(self.base_batch * scale for scale in scales)

    def goodput(self, gpus: int, batch: int, epoch: int) -> float:
        del epoch
        if not self.min_gpus <= gpus <= self.max_gpus:
            return 0.0
        return self.gain(batch) / self.fit.iteration_s(gpus, batch)

    def best_batch(self, gpus: int, epoch: int) -> tuple[int, float]:
        return max(((batch, self.goodput(gpus, batch, epoch)) for batch in self.batches()), key=lambda bg: bg[1])


def speed_model(job: Job, points: Sequence[SpeedPoint], *, total_gpus: int, rigid: bool) -> LiveSpeed:
    """The job's speed model from its measured points (none: :func:`unmeasured`)."""
    if not points:
        return unmeasured(job.gpus, job.batch, job.steps, total_gpus=total_gpus, rigid=rigid)
    fit = IterationFit.fit([(p.gpus, p.batch, p.iteration_s) for p in points])
    noise = next((p.gns for p in reversed(points) if p.gns is not None), None)
    low, high = (job.gpus, job.gpus) if rigid else (1, total_gpus)
    return LiveSpeed(steps=job.steps, base_batch=job.batch, fit=fit, noise_scale=noise, min_gpus=low,
                     max_gpus=high)


@functools.lru_cache(maxsize=4096)
def unmeasured(gpus: int, batch: int, steps: int, *, total_gpus: int, rigid: bool) -> LiveSpeed:
    """The model of a job never measured, which asked for ``gpus`` GPUs at ``batch`` for ``steps`` steps: linear
    scaling from its asked GPUs (one second a step on them). A pure function of its arguments, kept for the many
    jobs that ask the same."""
    low, high = (gpus, gpus) if rigid else (1, total_gpus)
    return LiveSpeed(steps=steps, base_batch=batch, fit=IterationFit(alpha=0.0, beta=gpus / batch), noise_scale=None,
                     min_gpus=low, max_gpus=high)
