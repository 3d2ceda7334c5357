"""The zoo as a sweep: every model planned, run with ``--check`` and timed, with the tracer that took it.

    python benchmarks/zoo_sweep.py [--models moe,hf_gpt2] [--ranks 2] [--write-docs]

For every model file under ``tests/models/zoo/``, as a user runs it (the ``deeppool`` CLI in a
subprocess): ``deeppool plan --device-model a100`` on ``--ranks`` GPUs at batch ``2 * ranks``; when the
ILP gives every layer one count, again with the first layer pinned to that count and the middle one to
another (1, or ``RANKS`` when the one count is 1), so the plan is burst parallel; then ``deeppool run --nproc RANKS --steps 2 --warmup 0 --check``. Reported per
model: the tracer that made its graph (fx, export, real: the real-tensor tracer, "+ N opaque" for
submodules run eagerly as one layer), its layers and GPU counts, the seconds to plan and to run, and
``--check``'s max relative difference (or the one-line error). The load average is printed before and
after: the machine is shared, and a busy one stretches the seconds, not the differences.
``--write-docs`` writes the table into docs/planner.md (region 'zoo-sweep').
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from deeppool.docregions import REPO, Stamp, markdown, write_region
from deeppool.model.trace import trace_spec
from deeppool.plans import ModelSpec

ZOO = REPO / "tests" / "models" / "zoo"
CLI = "import sys; from deeppool.cli import main; main(sys.argv[1:])"
_DIFFERENCE = re.compile(r"max relative difference: (\S+)")


@dataclass(frozen=True, kw_only=True)
class SweptModel:
    """One model's row: its tracer, layers and counts, seconds, and what ``--check`` found."""

    name: str
    tracer: str
    layers: int
    counts: str
    plan_s: float
    run_s: float
    check: str


def _tracer(name: str) -> str:
    _, traced = trace_spec(ModelSpec.parse(str(ZOO / f"{name}.py")), meta=True)
    opaque = sum(1 for layer in traced.graph.layers if layer.opaque)
    return traced.graph.method.value + (f" + {opaque} opaque" if opaque else "")


def _cli(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CLI, *args], check=False, capture_output=True, text=True, cwd=REPO)
    return done, time.perf_counter() - start


def _error(done: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in done.stderr.strip().splitlines() if line.startswith("error: ")]
    return lines[-1] if lines else f"exit {done.returncode}"


def _sweep(name: str, ranks: int, folder: Path) -> SweptModel:
    tracer = _tracer(name)
    plan = folder / f"{name}.json"
    args = ("plan", str(ZOO / f"{name}.py"), "--gpus", str(ranks), "--batch", str(2 * ranks), "--device-model",
            "a100", "--out", str(plan))
    planned, plan_s = _cli(*args)
    if planned.returncode != 0:
        return SweptModel(name=name, tracer=tracer, layers=0, counts="", plan_s=plan_s, run_s=0.0, check=_error(planned))
    layers = json.loads(plan.read_text())["layers"]
    counts = {layer["gpus"] for layer in layers}
    if len(counts) == 1:
        (count,) = counts
        other = ranks if count == 1 else 1
        again, seconds = _cli(*args, "--pin", f"{layers[0]['name']}={count}",
                              "--pin", f"{layers[len(layers) // 2]['name']}={other}")
        plan_s += seconds
        if again.returncode != 0:
            return SweptModel(name=name, tracer=tracer, layers=len(layers), counts="", plan_s=plan_s, run_s=0.0,
                         check=_error(again))
        layers = json.loads(plan.read_text())["layers"]
    counts = ",".join(str(count) for count in sorted({layer["gpus"] for layer in layers}))
    ran, run_s = _cli("run", str(plan), "--nproc", str(ranks), "--steps", "2", "--warmup", "0", "--check",
                      "--out", str(folder / f"{name}-run"))
    found = _DIFFERENCE.search(ran.stdout)
    check = found.group(1) if ran.returncode == 0 and found else _error(ran)
    return SweptModel(name=name, tracer=tracer, layers=len(layers), counts=counts, plan_s=plan_s, run_s=run_s, check=check)


def _table(rows: list[SweptModel], ranks: int) -> Table:
    table = Table(title=f"The zoo planned (a100 estimates, {ranks} GPUs, batch {2 * ranks}, burst) and run with "
                        f"--check on {ranks} gloo ranks")
    for column in ("model", "tracer", "layers", "GPU counts", "plan s", "run s", "--check max rel. difference"):
        table.add_column(column, justify="right" if column.endswith(" s") or column == "layers" else "left")
    for row in rows:
        table.add_row(row.name, row.tracer, str(row.layers), row.counts, f"{row.plan_s:.1f}", f"{row.run_s:.1f}",
                      row.check)
    return table


def _load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(sorted(p.stem for p in ZOO.glob("*.py") if p.stem != "__init__")))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--write-docs", action="store_true",
                        help="also write the table into docs/planner.md (region 'zoo-sweep')")
    args = parser.parse_args()
    stamp = Stamp.started()
    before = _load()
    console = Console(width=200)
    rows: list[SweptModel] = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models.split(","):
            rows.append(_sweep(name, args.ranks, Path(folder)))
            row = rows[-1]
            console.print(f"{name}: {row.tracer}, plan {row.plan_s:.1f} s, run {row.run_s:.1f} s, {row.check}; "
                          f"load {_load()}", highlight=False, markup=False)
    table = _table(rows, args.ranks)
    console.print(table)
    note = f"Load average before {before}, after {_load()} (2 shared cores: the seconds are upper bounds)."
    console.print(note)
    if args.write_docs:
        write_region(REPO / "docs" / "planner.md", "zoo-sweep", f"{markdown(table)}\n\n{note}", stamp)


if __name__ == "__main__":
    main()
