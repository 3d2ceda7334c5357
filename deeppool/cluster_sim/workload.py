"""Workloads: the jobs a simulation replays, read from a trace or generated.

Two trace formats are read (see ``deeppool/cluster_sim/data/README.md``; the data
are from the Pollux OSDI'21 artifact, petuum/adaptdl branch osdi21-artifact,
Apache-2.0, and ``philly.csv`` is derived from the Microsoft Philly traces,
msr-fiddle/philly-traces, CC-BY-4.0):

* **Philly-derived** ``timestamp,duration,num_gpus,gpu_time,cluster``: absolute
  submission dates, read as UTC whatever the machine's time zone (seconds from
  the earliest), the recorded run time under
  the recorded GPU count. The virtual cluster id is the model-mapping key.
* **Pollux** ``name,time,application,num_replicas,batch_size``: arrival in
  seconds, the application is the model-mapping key. Pollux workloads record
  no run time; it is derived from the application's measured data
  (:mod:`deeppool.cluster_sim.pollux`) unless the file has a ``duration`` column.

Either file may carry a ``background`` column (true/false) that the
``column`` background rule reads. Every malformed row is reported with the
file, line number and field; so are duplicate job names and run times over
``MAX_DURATION_S`` (a year: the longest Philly job ran 54 days).
"""

from __future__ import annotations

import csv
import enum
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from deeppool.errors import DeeppoolError

PHILLY_COLUMNS = ("timestamp", "duration", "num_gpus", "gpu_time", "cluster")
POLLUX_COLUMNS = ("name", "time", "application", "num_replicas", "batch_size")
_TRUE = {"1", "true", "yes", "bg", "background"}
_FALSE = {"0", "false", "no", "fg", "foreground", ""}
MAX_DURATION_S = 365 * 24 * 3600.0


class TraceFormat(enum.Enum):
    PHILLY = "philly"
    POLLUX = "pollux"
    SYNTHETIC = "synthetic"


@dataclass(frozen=True, kw_only=True)
class TraceJob:
    """One job as the workload states it, before it is mapped to a model."""

    name: str
    arrival_s: float
    gpus: int
    duration_s: float
    key: str
    batch_size: int | None = None
    background: bool | None = None
    where: str = ""


@dataclass(frozen=True, kw_only=True)
class Workload:
    source: str
    format: TraceFormat
    jobs: tuple[TraceJob, ...]

    def __post_init__(self) -> None:
        if not self.jobs:
            raise DeeppoolError(f"workload {self.source} has no jobs")
        seen: dict[str, TraceJob] = {}
        for job in self.jobs:
            first = seen.setdefault(job.name, job)
            if first is not job:
                raise DeeppoolError(f"{job.where}: job name '{job.name}' is already used at {first.where}: names must be unique")


@dataclass(frozen=True)
class _Row:
    path: Path
    line: int
    values: dict[str, str]

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def fail(self, column: str, problem: str) -> DeeppoolError:
        return DeeppoolError(f"{self.where}: field '{column}': {problem}")

    def text(self, column: str) -> str:
        value = (self.values.get(column) or "").strip()
        if not value:
            raise self.fail(column, "is empty")
        return value

    def number(self, column: str, *, minimum: float = 0.0, maximum: float = math.inf) -> float:
        raw = self.text(column)
        try:
            value = float(raw)
        except ValueError:
            raise self.fail(column, f"'{raw}' is not a number") from None
        if not math.isfinite(value) or value < minimum:
            raise self.fail(column, f"{raw} must be a finite number >= {minimum:g}")
        if value > maximum:
            raise self.fail(column, f"{raw} s is over {maximum:g} s: not a real job's run time")
        return value

    def duration(self) -> float:
        return self.number("duration", minimum=1e-9, maximum=MAX_DURATION_S)

    def count(self, column: str) -> int:
        raw = self.text(column)
        try:
            value = int(float(raw))
        except ValueError:
            raise self.fail(column, f"'{raw}' is not an integer") from None
        if value < 1 or value != float(raw):
            raise self.fail(column, f"{raw} must be a whole number >= 1")
        return value

    def flag(self, column: str) -> bool | None:
        if column not in self.values:
            return None
        raw = (self.values[column] or "").strip().lower()
        if raw in _TRUE:
            return True
        if raw in _FALSE:
            return False
        raise self.fail(column, f"'{raw}' is not true/false")


def read_workload(path: str | Path, *, pollux_traces: Path | None = None) -> Workload:
    """Read a Philly-derived or Pollux workload, telling them apart by their header."""
    source = Path(path)
    if not source.is_file():
        raise DeeppoolError(f"trace file '{path}' does not exist: check the path")
    header, rows = _rows(source)
    if set(PHILLY_COLUMNS) <= set(header):
        return Workload(source=str(source), format=TraceFormat.PHILLY, jobs=_philly(rows))
    if set(POLLUX_COLUMNS) - {"batch_size"} <= set(header):
        jobs = _pollux(rows, source, pollux_traces)
        return Workload(source=str(source), format=TraceFormat.POLLUX, jobs=jobs)
    raise DeeppoolError(
        f"{source}:1: header {','.join(header)} is neither the Philly format "
        f"({','.join(PHILLY_COLUMNS)}) nor the Pollux one ({','.join(POLLUX_COLUMNS)})"
    )


def _rows(path: Path) -> tuple[list[str], list[_Row]]:
    try:
        lines = path.read_text().splitlines()
    except UnicodeDecodeError:
        raise DeeppoolError(f"trace file '{path}' is not text: give a CSV file") from None
    if not lines:
        raise DeeppoolError(f"{path}:1: the file is empty; it needs a CSV header")
    reader = csv.reader(lines)
    header = [name.strip() for name in next(reader)]
    rows = []
    for number, fields in enumerate(reader, start=2):
        if not any(value.strip() for value in fields):
            continue
        if len(fields) != len(header):
            raise DeeppoolError(f"{path}:{number}: has {len(fields)} fields, the header names {len(header)}")
        rows.append(_Row(path, number, dict(zip(header, fields, strict=True))))
    return header, rows


def _philly(rows: list[_Row]) -> tuple[TraceJob, ...]:
    stamps = [_timestamp(row) for row in rows]
    first = min(stamps, default=0.0)
    jobs = [
        TraceJob(
            name=f"philly-{index}",
            arrival_s=stamp - first,
            gpus=row.count("num_gpus"),
            duration_s=row.duration(),
            key=row.text("cluster"),
            background=row.flag("background"),
            where=row.where,
        )
        for index, (row, stamp) in enumerate(zip(rows, stamps, strict=True))
    ]
    return tuple(sorted(jobs, key=lambda job: job.arrival_s))


def _timestamp(row: _Row) -> float:
    raw = row.text("timestamp")
    try:
        stamp = datetime.fromisoformat(raw)
    except ValueError:
        pass
    else:  # a date without a zone is UTC, never the machine's local time
        return (stamp if stamp.tzinfo is not None else stamp.replace(tzinfo=timezone.utc)).timestamp()
    try:
        return float(raw)
    except ValueError:
        raise row.fail("timestamp", f"'{raw}' is neither a date (YYYY-MM-DD HH:MM:SS) nor seconds") from None


def _pollux(rows: list[_Row], source: Path, traces: Path | None) -> tuple[TraceJob, ...]:
    from deeppool.cluster_sim.pollux import PolluxDurations

    durations = None
    jobs = []
    for row in rows:
        gpus = row.count("num_replicas")
        batch = row.count("batch_size") if "batch_size" in row.values else None
        application = row.text("application")
        if "duration" in row.values:
            duration = row.duration()
        else:
            durations = durations or PolluxDurations.locate(source, traces)
            duration = durations.duration_s(application, gpus, batch, where=row.where)
        jobs.append(
            TraceJob(
                name=row.text("name"),
                arrival_s=row.number("time"),
                gpus=gpus,
                duration_s=duration,
                key=application,
                batch_size=batch,
                background=row.flag("background"),
                where=row.where,
            )
        )
    return tuple(sorted(jobs, key=lambda job: job.arrival_s))


@dataclass(frozen=True, kw_only=True)
class SyntheticSpec:
    """Poisson arrivals, a GPU-count mix and log-normal run times."""

    jobs: int
    arrivals_per_hour: float
    size_mix: tuple[tuple[int, float], ...] = ((1, 0.6), (2, 0.1), (4, 0.1), (8, 0.1), (16, 0.1))
    median_duration_s: float = 3600.0
    duration_sigma: float = 1.0
    keys: tuple[str, ...] = ("vgg16", "resnet50", "inception", "gpt2")
    seed: int = 0

    def __post_init__(self) -> None:
        if self.jobs < 1 or self.arrivals_per_hour <= 0 or self.median_duration_s <= 0:
            raise DeeppoolError("synthetic workload: --jobs, --arrival-rate and --median-duration must be positive")
        if not self.size_mix or any(g < 1 or w < 0 for g, w in self.size_mix) or sum(w for _, w in self.size_mix) <= 0:
            raise DeeppoolError("synthetic --size-mix must list GPUS:WEIGHT pairs with GPUS >= 1 and positive total weight")


def synthetic(spec: SyntheticSpec) -> Workload:
    """A reproducible synthetic workload (same spec and seed, same jobs)."""
    rng = random.Random(spec.seed)
    sizes = [g for g, _ in spec.size_mix]
    weights = [w for _, w in spec.size_mix]
    clock = 0.0
    jobs = []
    for index in range(spec.jobs):
        clock += rng.expovariate(spec.arrivals_per_hour / 3600.0)
        jobs.append(
            TraceJob(
                name=f"synthetic-{index}",
                arrival_s=clock,
                gpus=rng.choices(sizes, weights)[0],
                duration_s=spec.median_duration_s * math.exp(rng.gauss(0.0, spec.duration_sigma)),
                key=rng.choice(spec.keys),
                where=f"synthetic job {index}",
            )
        )
    return Workload(source=f"synthetic(seed={spec.seed})", format=TraceFormat.SYNTHETIC, jobs=tuple(jobs))


def parse_size_mix(text: str) -> tuple[tuple[int, float], ...]:
    """``"1:0.6,4:0.2,8:0.2"`` to ((1, 0.6), (4, 0.2), (8, 0.2))."""
    pairs = []
    for item in text.split(","):
        gpus, _, weight = item.partition(":")
        try:
            pairs.append((int(gpus), float(weight or 1)))
        except ValueError:
            raise DeeppoolError(f"--size-mix item '{item}' is not GPUS:WEIGHT (e.g. 1:0.6,8:0.4)") from None
    return tuple(pairs)


class BackgroundKind(enum.Enum):
    MAX_GPUS = "max-gpus"
    KEYS = "keys"
    COLUMN = "column"
    NONE = "none"


@dataclass(frozen=True, kw_only=True)
class BackgroundRule:
    """Which jobs are background jobs. Default: jobs asking for at most one GPU."""

    kind: BackgroundKind = BackgroundKind.MAX_GPUS
    max_gpus: int = 1
    keys: frozenset[str] = frozenset()

    def is_background(self, job: TraceJob) -> bool:
        return _RULES[self.kind](self, job)

    def describe(self) -> str:
        return {
            BackgroundKind.MAX_GPUS: f"jobs asking for <= {self.max_gpus} GPU(s)",
            BackgroundKind.KEYS: f"jobs of {', '.join(sorted(self.keys))}",
            BackgroundKind.COLUMN: "the trace's 'background' column",
            BackgroundKind.NONE: "none",
        }[self.kind]

    @classmethod
    def parse(cls, text: str) -> BackgroundRule:
        """``gpus<=N`` | ``app:a,b`` | ``column`` | ``none``."""
        text = text.strip()
        if text.startswith("gpus<="):
            try:
                return cls(kind=BackgroundKind.MAX_GPUS, max_gpus=int(text[6:]))
            except ValueError:
                pass
        elif text.startswith("app:") and text[4:]:
            return cls(kind=BackgroundKind.KEYS, keys=frozenset(k.strip() for k in text[4:].split(",")))
        elif text in ("column", "none"):
            return cls(kind=BackgroundKind(text))
        raise DeeppoolError(f"--background '{text}': use gpus<=N, app:NAME[,NAME], column or none")


def _column(rule: BackgroundRule, job: TraceJob) -> bool:
    if job.background is None:
        raise DeeppoolError(f"{job.where}: --background column, but the trace has no 'background' column")
    return job.background


_RULES: dict[BackgroundKind, Callable[[BackgroundRule, TraceJob], bool]] = {
    BackgroundKind.MAX_GPUS: lambda rule, job: job.gpus <= rule.max_gpus,
    BackgroundKind.KEYS: lambda rule, job: job.key in rule.keys,
    BackgroundKind.COLUMN: _column,
    BackgroundKind.NONE: lambda rule, job: False,
}


def iter_keys(workload: Workload) -> Iterator[str]:
    return iter(dict.fromkeys(job.key for job in workload.jobs))
