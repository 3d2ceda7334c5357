"""Run times of Pollux workload jobs, from the applications' measured data, as Pollux's simulator derives them.

A Pollux workload (Qiao et al., OSDI 2021; petuum/adaptdl, branch
osdi21-artifact, folder ``simulator/``, Apache-2.0) states each job's
application, GPU count and batch size but not its run time. The artifact's
simulator (``applications.py``, ``simulator.py``: ``Job.update_local_bsz``,
``Job.step``) turns them into one; this module follows it for a job that keeps
its batch size and GPUs (Tiresias+TunedJobs):

* **Work.** Training ends after the application's ``max_epochs`` epochs.
  Epoch ``e`` needs progress ``P(e+1) − P(e)``, where ``P(e)`` is the smallest
  ``progress`` column at epoch ``e`` over the ``validation-<batch>.csv`` files;
  a step at global batch ``B`` makes progress
  ``gain = (var + sqr) / (var / s + sqr)``, ``s = B / B_init`` (``B_init`` the
  smallest validated batch; ``sqr``, ``var`` the gradient statistics of epoch
  ``e`` interpolated linearly between the validated batches around ``B``).
  Steps = Σ_e (P(e+1) − P(e)) / gain(B, e).
* **Step time.** The per-GPU batch ``⌈B / gpus⌉`` is split into ``accum + 1``
  micro-batches of at most the largest measured per-GPU batch
  (``max_local_bsz``; a one-GPU job above ``B_init`` accumulates at least once):
  ``T = step(atomic) + accum · (step(atomic) − sync(atomic))``. ``step`` and
  ``sync`` are ``placements.csv``'s for the packed placement ("4", "24",
  "444", ... up to 16 GPUs), linear in the per-GPU batch within the measured
  range (clamped to it); above 16 GPUs ``scalability.csv``'s, linear in the
  GPU count and the per-GPU batch, up to its measured maximum (64 replicas),
  beyond which a job is refused.

``duration = steps · T``. ``max_epochs`` and the yolov3 micro-batch cap are the
artifact's ``APPLICATIONS`` settings.

For a co-adaptive policy (:mod:`deeppool.scheduling.pollux`) an application is
also a *speed model*: progress is counted as the artifact counts it
(``P``, summed gains), a job at progress ``p`` is in epoch ``e(p)``, the first
with ``P(e+1) > p``, and on ``g`` GPUs at global batch ``B`` it progresses at

    goodput(g, B, e) = gain(B, e) / T(g, B)        (progress per second)

``best_batch(g, e)`` maximises it over a grid of global batches from
``max(B_init, g · min_local_bsz)`` to the largest validated batch (the
artifact's ``GoodputFunction.optimize`` searches the same range, with
accumulation past ``max_local_bsz``). ncf keeps its batch (32,768) and one GPU,
as the artifact's Pollux runs it.
"""

from __future__ import annotations

import bisect
import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

from deeppool.errors import DeeppoolError

NODE_GPUS = 4
MAX_PLACEMENT_GPUS = 16
MAX_EPOCHS = {"bert": 2, "cifar10": 100, "ncf": 10, "imagenet": 90, "deepspeech2": 80, "yolov3": 50}
MAX_LOCAL_BSZ = {"yolov3": 8}
"""The artifact's ``APPLICATIONS`` (simulator/applications.py): epochs to train, micro-batch caps."""
FIXED = {"ncf": (32768, 1)}
"""Applications the artifact's Pollux runs at a fixed (batch, GPUs): simulator.py sets ncf's."""
MAX_GPUS = 64
"""The artifact's cap on one job's GPUs under Pollux ("simulator can't handle more")."""
BATCH_GRID = 24
"""Global batches tried per GPU count by ``best_batch`` (log-spaced, both ends included)."""
PROGRESS_TOLERANCE = 1e-9
"""Relative to the total: progress this close to an epoch's end counts as past it (rounding)."""


def packed_placement(gpus: int) -> str:
    """``gpus`` on as few 4-GPU nodes as possible, digits ascending (as placements.csv writes them)."""
    digits = [NODE_GPUS] * (gpus // NODE_GPUS) + ([gpus % NODE_GPUS] if gpus % NODE_GPUS else [])
    return "".join(str(d) for d in sorted(digits))


@dataclass(frozen=True, kw_only=True)
class Curve:
    """(per-GPU batch → step time, sync time), measured at a few batches."""

    batches: tuple[float, ...]
    steps: tuple[float, ...]
    syncs: tuple[float, ...]

    def at(self, local_batch: float) -> tuple[float, float]:
        """Linear in the per-GPU batch, clamped to the measured range."""
        xs = self.batches
        x = min(max(local_batch, xs[0]), xs[-1])
        index = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1) if len(xs) > 1 else 0
        if len(xs) == 1:
            return self.steps[0], self.syncs[0]
        x0, x1 = xs[index - 1], xs[index]
        weight = (x - x0) / (x1 - x0) if x1 > x0 else 1.0  # a batch measured twice: the later row
        return (self.steps[index - 1] + weight * (self.steps[index] - self.steps[index - 1]),
                self.syncs[index - 1] + weight * (self.syncs[index] - self.syncs[index - 1]))


@dataclass(frozen=True, kw_only=True)
class Epoch:
    progress: float
    grad_sqr: float
    grad_var: float


@dataclass(frozen=True, kw_only=True, eq=False)
class Application:
    """One application's measurements (``traces/<application>/``)."""

    name: str
    validation: dict[int, tuple[Epoch, ...]]
    placements: dict[str, Curve]
    scalability: dict[int, Curve]
    max_local_bsz: float
    max_epochs: int
    _memo: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def init_batch(self) -> int:
        return min(self.validation)

    @property
    def max_batch(self) -> int:
        return max(self.validation)

    @classmethod
    def read(cls, folder: Path) -> Application:
        validation = {int(path.stem.split("-", 1)[1]): _epochs(path) for path in folder.glob("validation-*.csv")}
        if not validation:
            raise DeeppoolError(f"{folder}: no validation-<batch>.csv files")
        placements = _curves(folder / "placements.csv", "placement", str)
        name = folder.name
        measured_max = max(max(curve.batches) for curve in placements.values())
        return cls(
            name=name,
            validation=validation,
            placements=placements,
            scalability=_curves(folder / "scalability.csv", "num_replicas", lambda v: int(float(v))),
            max_local_bsz=MAX_LOCAL_BSZ.get(name, measured_max),
            max_epochs=MAX_EPOCHS.get(name, min(len(rows) for rows in validation.values())),
        )

    @property
    def min_local_bsz(self) -> float:
        return min(min(curve.batches) for curve in self.placements.values())

    @property
    def total_progress(self) -> float:
        return self.progress_at(self.max_epochs)

    @property
    def min_gpus(self) -> int:
        return 1

    @property
    def max_gpus(self) -> int:
        """The most GPUs a job may hold: one per ``min_local_bsz`` samples of the largest batch, at most 64."""
        if self.name in FIXED:
            return FIXED[self.name][1]
        return max(1, min(MAX_GPUS, int(self.max_batch // self.min_local_bsz)))

    def progress_at(self, epoch: int) -> float:
        """``P(e)``: the progress training has made when epoch ``e`` begins (the least over validated batches)."""
        if epoch <= 0:
            return 0.0
        return min(rows[epoch - 1].progress for rows in self.validation.values())

    def epoch_at(self, progress: float) -> int:
        """The epoch a job at ``progress`` is in: the first ``e`` with ``P(e+1) > progress`` (within rounding)."""
        past = progress + PROGRESS_TOLERANCE * self.total_progress
        return next((e for e in range(self.max_epochs) if self.progress_at(e + 1) > past), self.max_epochs - 1)

    def goodput(self, gpus: int, batch: int, epoch: int) -> float:
        """Progress per second on ``gpus`` packed GPUs at global ``batch`` in ``epoch``: gain / step time."""
        return self._gain(batch, epoch) / self.step_time_s(gpus, batch)

    def best_batch(self, gpus: int, epoch: int) -> tuple[int, float]:
        """The global batch with the best goodput on ``gpus`` GPUs in ``epoch``, and that goodput (0: infeasible)."""
        key = (gpus, epoch)
        if key not in self._memo:
            self._memo[key] = self._best_batch(gpus, epoch)
        return self._memo[key]

    def _best_batch(self, gpus: int, epoch: int) -> tuple[int, float]:
        if self.name in FIXED:
            batch, most = FIXED[self.name]
            return (batch, self.goodput(gpus, batch, epoch)) if gpus <= most else (batch, 0.0)
        low, high = max(self.init_batch, math.ceil(gpus * self.min_local_bsz)), self.max_batch
        if gpus > self.max_gpus or low > high:
            return low, 0.0
        grid = {low, high} | {round(low * (high / low) ** (k / (BATCH_GRID - 1))) for k in range(BATCH_GRID)}
        return max(((b, self.goodput(gpus, b, epoch)) for b in sorted(grid)), key=lambda pair: pair[1])

    def steps_to_finish(self, batch: int) -> float:
        """Σ over epochs of the progress the epoch needs over the progress one step makes at ``batch``."""
        steps, previous = 0.0, 0.0
        for epoch in range(self.max_epochs):
            target = min(rows[epoch].progress for rows in self.validation.values())
            steps += (target - previous) / self._gain(batch, epoch)
            previous = target
        return steps

    def step_time_s(self, gpus: int, batch: int) -> float:
        """Seconds per optimizer step on ``gpus`` packed GPUs, with gradient accumulation past the cap."""
        local = math.ceil(batch / gpus - 1e-8)
        accum = math.ceil(local / self.max_local_bsz - 1e-8) - 1
        if gpus == 1 and batch > self.init_batch:
            accum = max(1, accum)
        atomic = math.ceil(local / (accum + 1) - 1e-8)
        atomic = min(atomic, int(self.max_batch / (gpus * (accum + 1))))
        step, sync = self._throughput(gpus, atomic)
        return step + accum * (step - sync)

    def _gain(self, batch: int, epoch: int) -> float:
        sqr, var = self._grad_stats(batch, epoch)
        scale = batch / self.init_batch
        return (var + sqr) / (var / scale + sqr)

    def _grad_stats(self, batch: int, epoch: int) -> tuple[float, float]:
        sizes = sorted(self.validation)
        lower = max(b for b in sizes if b <= batch)
        upper = min(b for b in sizes if b >= batch)
        low, high = self.validation[lower][epoch], self.validation[upper][epoch]
        if lower == upper:
            return low.grad_sqr, low.grad_var
        weight = (batch - lower) / (upper - lower)
        return (low.grad_sqr + weight * (high.grad_sqr - low.grad_sqr),
                low.grad_var + weight * (high.grad_var - low.grad_var))

    def _throughput(self, gpus: int, local_batch: float) -> tuple[float, float]:
        if gpus <= MAX_PLACEMENT_GPUS:
            return self.placements[packed_placement(gpus)].at(local_batch)
        counts = sorted(self.scalability)
        index = bisect.bisect_left(counts, gpus)
        if counts[index] == gpus:
            return self.scalability[gpus].at(local_batch)
        below, above = counts[index - 1], counts[index]
        (s0, y0), (s1, y1) = self.scalability[below].at(local_batch), self.scalability[above].at(local_batch)
        weight = (gpus - below) / (above - below)
        return s0 + weight * (s1 - s0), y0 + weight * (y1 - y0)


@dataclass
class PolluxDurations:
    """Reads (and caches) the measured data under the artifact's ``traces/`` folder."""

    root: Path
    _apps: dict[str, Application] = field(default_factory=dict)

    @classmethod
    def locate(cls, workload: Path, traces: Path | None) -> PolluxDurations:
        root = traces if traces is not None else workload.resolve().parent.parent / "traces"
        if not root.is_dir():
            raise DeeppoolError(
                f"{workload}: a Pollux workload records no run times and '{root}' is not the artifact's "
                "traces/ folder: pass --pollux-traces DIR or add a 'duration' column"
            )
        return cls(root=root)

    def duration_s(self, application: str, gpus: int, batch: int | None, *, where: str) -> float:
        if batch is None:
            raise DeeppoolError(f"{where}: field 'batch_size': needed to derive the run time")
        app = self.application(application, where=where)
        if not app.init_batch <= batch <= app.max_batch:
            raise DeeppoolError(f"{where}: field 'batch_size': {batch} is outside {application}'s validated "
                                f"batches {app.init_batch}..{app.max_batch}")
        top = max(app.scalability, default=MAX_PLACEMENT_GPUS)
        if gpus > max(top, MAX_PLACEMENT_GPUS):
            raise DeeppoolError(f"{where}: field 'num_replicas': {gpus} GPUs is beyond {application}'s measured "
                                f"maximum of {top}")
        return app.steps_to_finish(batch) * app.step_time_s(gpus, batch)

    def application(self, name: str, *, where: str) -> Application:
        if name not in self._apps:
            folder = self.root / name
            if not (folder / "placements.csv").is_file():
                raise DeeppoolError(f"{where}: field 'application': no measured data for '{name}' in {self.root}")
            self._apps[name] = Application.read(folder)
        return self._apps[name]


def _epochs(path: Path) -> tuple[Epoch, ...]:
    with path.open() as handle:
        rows = [Epoch(progress=float(row["progress"]), grad_sqr=float(row["grad_sqr"]), grad_var=float(row["grad_var"]))
                for row in csv.DictReader(handle)]
    if not rows:
        raise DeeppoolError(f"{path}: has no rows")
    return tuple(rows)


def _curves(path: Path, column: str, key) -> dict:
    """Rows of ``path`` grouped by ``column`` into step/sync curves over the per-GPU batch."""
    if not path.is_file():
        return {}
    points: dict = {}
    with path.open() as handle:
        for row in csv.DictReader(handle):
            points.setdefault(key(row[column]), []).append(
                (float(row["local_bsz"]), float(row["step_time"]), float(row["sync_time"])))
    return {
        name: Curve(batches=tuple(p[0] for p in rows), steps=tuple(p[1] for p in rows), syncs=tuple(p[2] for p in rows))
        for name, rows in ((name, sorted(rows)) for name, rows in points.items())
    }
