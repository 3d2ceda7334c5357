"""The traces that ship with deeppool, findable by name: ``philly``, ``workload-6``, ``workloads-2.0/workload-6``.

They live under ``deeppool/cluster_sim/data/`` (installed with the package); ``data/README.md`` describes
them and keeps their attribution: the Pollux OSDI'21 artifact (petuum/adaptdl, branch ``osdi21-artifact``,
Apache-2.0), whose ``philly.csv`` is derived from the Microsoft Philly traces (msr-fiddle/philly-traces,
CC-BY-4.0).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from deeppool.errors import DeeppoolError

DATA = Path(__file__).parent / "data"
POLLUX = DATA / "pollux-osdi21"
POLLUX_TRACES = POLLUX / "traces"
"""The Pollux artifact's measured applications (``bert/``, ``cifar10/``...): their run times and statistics."""
PHILLY = POLLUX_TRACES / "philly.csv"


@dataclass(frozen=True, kw_only=True)
class ShippedTrace:
    name: str
    path: Path
    jobs: int

    def describe(self) -> str:
        return f"{self.name:<28} {self.jobs:>7,} jobs  {self.path.relative_to(DATA.parent.parent.parent)}"


def shipped() -> tuple[ShippedTrace, ...]:
    """Every shipped trace, by name: ``philly`` first, then each Pollux workload (``workloads-S/`` scaled by S)."""
    found = [ShippedTrace(name="philly", path=PHILLY, jobs=_rows(PHILLY))]
    for folder in sorted(POLLUX.glob("workloads*")):
        for path in sorted(folder.glob("workload-*.csv"), key=lambda p: int(p.stem.split("-")[1])):
            name = path.stem if folder.name == "workloads" else f"{folder.name}/{path.stem}"
            found.append(ShippedTrace(name=name, path=path, jobs=_rows(path)))
    return tuple(found)


def resolve(trace: str) -> Path:
    """An existing file as given, else the shipped trace of that name; an unknown name is one ``error:`` line."""
    given = Path(trace)
    if given.is_file():
        return given
    by_name = {entry.name: entry.path for entry in shipped()}
    if trace.removesuffix(".csv") in by_name:
        return by_name[trace.removesuffix(".csv")]
    raise DeeppoolError(f"trace file '{trace}' does not exist and is not a shipped trace (philly, workload-1 .. "
                        "workload-8, workloads-2.0/workload-6...): check the path or see `deeppool simulate "
                        "--list-traces`")


def _rows(path: Path) -> int:
    with path.open() as handle:
        return sum(1 for line in handle if line.strip()) - 1
