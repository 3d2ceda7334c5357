"""Run times of Pollux workload jobs, from the applications' measured data.

A Pollux workload (Qiao et al., OSDI 2021; petuum/adaptdl, branch
osdi21-artifact, Apache-2.0) states each job's application, GPU count and
batch size but not its run time. The run time under that recorded allocation
is derived from the artifact's measurements on AWS g4dn (T4 GPUs, 4 per node):

    duration = iterations_to_target(batch) · step_time(placement, batch / gpus)

* ``iterations_to_target``: the last ``iteration`` of ``validation-<batch>.csv``
  (the run that reached the target metric); the closest measured batch when
  that batch has no file.
* ``step_time``: ``placements.csv`` rows of the packed placement of ``gpus``
  on 4-GPU nodes ("4", "24", "444"...), interpolated linearly in the per-GPU
  batch. Placements above 16 GPUs were not measured; they use the 16-GPU
  ("4444") step time, i.e. weak scaling beyond 16 GPUs is taken as flat.
"""

from __future__ import annotations

import bisect
import csv
import math
from dataclasses import dataclass, field
from pathlib import Path

from deeppool.errors import DeeppoolError

NODE_GPUS = 4
MAX_MEASURED_GPUS = 16


def packed_placement(gpus: int) -> str:
    """``gpus`` on as few 4-GPU nodes as possible, digits ascending (as placements.csv writes them)."""
    gpus = min(gpus, MAX_MEASURED_GPUS)
    digits = [NODE_GPUS] * (gpus // NODE_GPUS) + ([gpus % NODE_GPUS] if gpus % NODE_GPUS else [])
    return "".join(str(d) for d in sorted(digits))


@dataclass
class PolluxDurations:
    """Reads (and caches) the measured data under the artifact's ``traces/`` folder."""

    root: Path
    _steps: dict[tuple[str, str], tuple[list[float], list[float]]] = field(default_factory=dict)
    _iterations: dict[str, dict[int, int]] = field(default_factory=dict)

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
        folder = self.root / application
        if not (folder / "placements.csv").is_file():
            raise DeeppoolError(f"{where}: field 'application': no measured data for '{application}' in {self.root}")
        iterations = self._iterations_to_target(folder, application, batch)
        return iterations * self._step_time(folder, application, gpus, batch / gpus)

    def _iterations_to_target(self, folder: Path, application: str, batch: int) -> int:
        if application not in self._iterations:
            self._iterations[application] = {
                int(path.stem.split("-", 1)[1]): _last_iteration(path)
                for path in folder.glob("validation-*.csv")
            }
        table = self._iterations[application]
        if not table:
            raise DeeppoolError(f"{folder}: no validation-<batch>.csv files")
        closest = min(table, key=lambda b: abs(math.log(b / batch)))
        return table[closest]

    def _step_time(self, folder: Path, application: str, gpus: int, local_batch: float) -> float:
        placement = packed_placement(gpus)
        key = (application, placement)
        if key not in self._steps:
            self._steps[key] = _placement_rows(folder / "placements.csv", placement)
        batches, steps = self._steps[key]
        return _interpolate(batches, steps, local_batch)


def _last_iteration(path: Path) -> int:
    with path.open() as handle:
        rows = list(csv.DictReader(handle))
    if not rows:
        raise DeeppoolError(f"{path}: has no rows")
    return max(int(float(row["iteration"])) for row in rows)


def _placement_rows(path: Path, placement: str) -> tuple[list[float], list[float]]:
    with path.open() as handle:
        rows = [row for row in csv.DictReader(handle) if row["placement"] == placement]
    if not rows:
        raise DeeppoolError(f"{path}: no measurement for placement '{placement}'")
    points = sorted((float(row["local_bsz"]), float(row["step_time"])) for row in rows)
    return [p[0] for p in points], [p[1] for p in points]


def _interpolate(xs: list[float], ys: list[float], x: float) -> float:
    """Linear in the per-GPU batch; below the smallest measured batch, the smallest's time."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    index = min(bisect.bisect_left(xs, x), len(xs) - 1)
    x0, x1, y0, y1 = xs[index - 1], xs[index], ys[index - 1], ys[index]
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 1e-9)
