"""Planning with local measuring: ``deeppool plan`` of ResNet-50 measured on this machine, from an empty cache.

    python benchmarks/local_plan.py [--model examples/resnet50.py] [--gpus 32] [--repeats 1] [--write-docs]

Runs the README's command without a device model (every layer measured here, the rest fitted) in a fresh
``--cache-dir``, as a real ``deeppool`` process, and reports its wall time, its peak memory (the largest
resident set of the process), the profile's fit line (how many measurements stayed noisy) and the machine's
load before and after: how long a user waits depends on how busy the machine is.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from deeppool.docregions import REPO, Stamp, markdown, write_region


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "examples" / "resnet50.py"))
    parser.add_argument("--gpus", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--write-docs", action="store_true",
                        help="also write the table into docs/performance.md (region 'local-plan')")
    args = parser.parse_args()
    stamp = Stamp.started()
    table = Table(title=f"deeppool plan {Path(args.model).name} --gpus {args.gpus}, measured here, empty cache")
    for column in ("run", "wall s", "peak RSS GB", "load before", "load after", "profile"):
        table.add_column(column, justify="left" if column == "profile" else "right")
    for run in range(1, args.repeats + 1):
        table.add_row(str(run), *_one(args.model, args.gpus))
        Console().print(table)
    if args.write_docs:
        write_region(REPO / "docs" / "performance.md", "local-plan", markdown(table), stamp)


def _one(model: str, gpus: int) -> tuple[str, ...]:
    with tempfile.TemporaryDirectory(prefix="deeppool-local-plan-") as folder:
        before = os.getloadavg()[0]
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "deeppool.cli", "plan", model, "--gpus", str(gpus), "--cache-dir",
                               str(Path(folder) / "cache"), "--out", str(Path(folder) / "plan.json")],
                              capture_output=True, text=True, check=True)
        wall = time.perf_counter() - started
        peak_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024**2
        fit = next((line for line in done.stdout.splitlines() if line.startswith("profile measured")), "")
        return (f"{wall:.1f}", f"{peak_gb:.1f}", f"{before:.1f}", f"{os.getloadavg()[0]:.1f}",
                fit.removeprefix("profile measured at "))


if __name__ == "__main__":
    main()
