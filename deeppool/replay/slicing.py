"""A slice of a trace, scaled to a small live cluster: when each job arrives, on how many slots, what it trains.

For jobs ``first .. first + jobs - 1`` of the trace (in arrival order) and a coordinator of ``slots`` slots:

* **time**: one factor ``time_scale = span_s / (last arrival - first arrival)`` compresses the arrivals
  (the first at 0, the last at ``span_s``) and each job's recorded run time alike, so the load keeps its
  shape; a run time is then held to ``[min_run_s, max_run_s]`` (a trace job of hours would hold the
  slice for its whole span, one of seconds would be all start-up);
* **size**: ``live GPUs = clamp(ceil(trace GPUs / gpu_scale), 1, slots)``, ``gpu_scale`` by default the
  slice's largest job over ``slots`` (that job takes the whole cluster);
* **model**: the trace's key (a Pollux application) goes through a model mapping
  (:mod:`deeppool.cluster_sim.models`) to a real model file and its batch rule;
* **kind**: under a policy that lends idle ranks (``...:burst+bg``) the jobs ``background`` names (by default, as
  ``simulate``'s, those asking for one trace GPU) are background jobs on one slot; otherwise every job is a
  foreground job;
* **work**: ``steps = round(run time / step_s)``, at least ``min_steps``, with ``step_s`` the iteration
  time of the model on that many slots: measured on the coordinator by a short job of each
  (:func:`deeppool.replay.live.calibrate`), or, without a coordinator (a dry run), its training step
  measured here at the per-rank batch (:func:`measure_step_s`), times ``slots / cores`` when a job's ranks
  outnumber the cores (:func:`sharing_cores`) — which misses the executor's own cost per layer.

The step time only sizes the jobs: the simulator is given the speeds the replayed jobs measure.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from deeppool.cluster_sim.models import ModelMapping
from deeppool.cluster_sim.workload import BackgroundRule, TraceJob, Workload
from deeppool.errors import DeeppoolError
from deeppool.scheduling.choice import ModelChoice

if TYPE_CHECKING:
    from deeppool.model.loading import LoadedModel

StepTimer = Callable[[ModelChoice, int], float]
"""(model at its global batch, live GPUs) -> seconds of one training step at the per-rank batch."""


@dataclass(frozen=True, kw_only=True)
class SliceSettings:
    """Which jobs of the trace, and how they are scaled onto ``slots`` slots (see the module docstring)."""

    slots: int
    first: int = 0
    jobs: int = 24
    span_s: float = 360.0
    gpu_scale: float | None = None
    min_run_s: float = 2.0
    max_run_s: float = 90.0
    min_steps: int = 10
    background: BackgroundRule | None = None
    """which trace jobs are submitted as background jobs (a lending policy's replay); None: none"""

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise DeeppoolError(f"the coordinator has {self.slots} slots: it needs at least 1")
        if self.first < 0:
            raise DeeppoolError(f"--first {self.first} must be 0 or more")
        if self.jobs < 2:
            raise DeeppoolError(f"--jobs {self.jobs} must be at least 2 (a slice has a first and a last arrival)")
        if not self.span_s > 0:
            raise DeeppoolError(f"--span {self.span_s} must be more than 0 seconds")
        if self.gpu_scale is not None and not self.gpu_scale > 0:
            raise DeeppoolError(f"--gpu-scale {self.gpu_scale} must be more than 0")
        if not 0 < self.min_run_s <= self.max_run_s:
            raise DeeppoolError(f"--min-run {self.min_run_s} and --max-run {self.max_run_s} need 0 < min <= max")
        if self.min_steps < 2:
            raise DeeppoolError(f"min_steps {self.min_steps} must be at least 2 (one warm-up, one measured)")


@dataclass(frozen=True, kw_only=True)
class ReplayJob:
    """One trace job as the live run submits it: ``arrival_s`` after the slice starts, ``gpus`` slots, its
    ``model`` at global batch ``model.global_batch``, ``steps`` training steps; ``trace`` is the row it came from."""

    name: str
    trace: TraceJob
    arrival_s: float
    gpus: int
    model: ModelChoice
    steps: int
    run_s: float
    """the training time it was sized for (scaled run time, held to the bounds)"""
    step_s: float = 0.0
    """the iteration time its steps were sized by (the calibration's, on its slots)"""
    background: bool = False
    """submitted as a background job (on one slot, or lent a running foreground job's idle ranks)"""

    @property
    def batch(self) -> int:
        return self.model.global_batch


@dataclass(frozen=True, kw_only=True)
class ReplaySlice:
    source: str
    settings: SliceSettings
    time_scale: float
    gpu_scale: float
    jobs: tuple[ReplayJob, ...]


def cut(workload: Workload, settings: SliceSettings) -> tuple[TraceJob, ...]:
    """Jobs ``first .. first + jobs - 1`` of ``workload`` in arrival order."""
    chosen = workload.jobs[settings.first:settings.first + settings.jobs]
    if len(chosen) < settings.jobs:
        raise DeeppoolError(f"{workload.source} has {len(workload.jobs)} jobs: --first {settings.first} "
                            f"--jobs {settings.jobs} runs past its end")
    if chosen[-1].arrival_s <= chosen[0].arrival_s:
        raise DeeppoolError(f"jobs {settings.first}..{settings.first + settings.jobs - 1} of {workload.source} "
                            "all arrive at once: there is no time to scale; take more jobs")
    return chosen


def scale(workload: Workload, settings: SliceSettings, mapping: ModelMapping, step_s: StepTimer,
          *, seed: int = 0) -> ReplaySlice:
    """The slice, scaled (the module docstring); ``step_s`` is called once per distinct (model, batch, GPUs)."""
    chosen = cut(workload, settings)
    start = chosen[0].arrival_s
    time_scale = settings.span_s / (chosen[-1].arrival_s - start)
    gpu_scale = settings.gpu_scale or max(1.0, max(job.gpus for job in chosen) / settings.slots)
    rng = random.Random(seed)
    timed: dict[tuple[str, int, int], float] = {}
    jobs = []
    for job in chosen:
        background = settings.background is not None and settings.background.is_background(job)
        gpus = 1 if background else min(settings.slots, max(1, math.ceil(job.gpus / gpu_scale - 1e-9)))
        model = _model(mapping.resolve(job.key, rng, where=job.where), gpus, job)
        key = (str(model.path), model.global_batch, gpus)
        if key not in timed:
            timed[key] = step_s(model, gpus)
        run_s = min(settings.max_run_s, max(settings.min_run_s, job.duration_s * time_scale))
        jobs.append(ReplayJob(name=job.name, trace=job, arrival_s=(job.arrival_s - start) * time_scale, gpus=gpus,
                              model=model, steps=max(settings.min_steps, round(run_s / timed[key])), run_s=run_s,
                              step_s=timed[key], background=background))
    return ReplaySlice(source=workload.source, settings=settings, time_scale=time_scale, gpu_scale=gpu_scale,
                       jobs=tuple(jobs))


def needs(workload: Workload, settings: SliceSettings, mapping: ModelMapping, *,
          seed: int = 0) -> list[tuple[ModelChoice, int]]:
    """Every distinct (model at its batch, slots) the slice trains: what a step timer is asked about."""
    found: dict[tuple[str, int, int], tuple[ModelChoice, int]] = {}

    def record(model: ModelChoice, gpus: int) -> float:
        found[(str(model.path), model.global_batch, gpus)] = (model, gpus)
        return 1.0

    scale(workload, settings, mapping, record, seed=seed)
    return list(found.values())


def _model(model: ModelChoice, gpus: int, job: TraceJob) -> ModelChoice:
    batch = model.batch_for(gpus, job.batch_size)
    if batch < gpus:
        raise DeeppoolError(f"{job.where}: job '{job.name}' would train at batch {batch} on {gpus} slots: give a "
                            "larger global_batch or a per_gpu_batch in the --mapping file")
    return replace(model, global_batch=batch, per_gpu_batch=None)


def sharing_cores(step_s: StepTimer, cores: int) -> StepTimer:
    """``step_s`` for ranks on CPU slots of a host with ``cores`` cores: ``gpus`` ranks share them."""
    return lambda model, gpus: step_s(model, gpus) * max(1.0, gpus / cores)


def measure_step_s(model: ModelChoice, gpus: int, *, steps: int = 5) -> float:
    """The median time of a training step (forward, backward, SGD) of ``model`` at its per-rank batch
    (``ceil(batch / gpus)``), in this process on one thread (as a rank sharing the host's cores): what sizes
    a job's steps, not what the simulator is given."""
    import torch

    from deeppool.model.loading import load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _median_step_s(load_model(model.spec), math.ceil(model.global_batch / gpus), steps)
    finally:
        torch.set_num_threads(threads)


def _median_step_s(loaded: LoadedModel, batch: int, steps: int) -> float:
    import torch

    optimizer = torch.optim.SGD(loaded.module.parameters(), lr=1e-3)
    inputs, targets = loaded.named_inputs(batch), loaded.targets(batch)
    times = []
    for _ in range(steps + 1):
        began = time.perf_counter()
        optimizer.zero_grad()
        loaded.loss(loaded.module(**inputs), targets).backward()
        optimizer.step()
        times.append(time.perf_counter() - began)
    return statistics.median(times[1:])
