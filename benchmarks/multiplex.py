"""Multiplexing benchmark: the planner's own plan of a new model, a real background in its idle time.

    python benchmarks/multiplex.py [--model examples/dlrm.py] [--runs 3] [--steps 35] [--batch 256]
                                   [--objective cluster] [--pin 'GLOB=N' ...] [--device-model local]
                                   [--out DIR] [--write-docs]

The foreground is ``examples/dlrm.py`` by default (a DLRM-style recommender:
embedding tables hold nearly all the parameters and little of the compute, so
data parallel all-reduces large gradients for little saved time), planned for
2 ranks through the public command, ``deeppool plan --objective cluster``
(measured on this machine by default; ``--objective`` and ``--pin`` are passed
on), so the layout is whatever the planner chooses: on this CPU, every layer on
one rank and the other lent for the whole iteration (data parallel on both, planned
with the network the plan probes, predicted 37.8 ms and ran 41.8 against about 7 on one,
2026-11-29). ``--model examples/mixer.py --batch 32`` is a
model that scales well here: the planner then keeps both ranks training and
lends nothing, unless ``--pin '*=1'`` says otherwise. The background is
``examples/background_mlp.py``. Each of ``--runs`` runs is one
``deeppool run --background --mux gate`` (interleaved A/B blocks: the
foreground alone vs shared, medians), with the load average read before and
after it; the table gives each run's figures and their median. Goal on CPU:
``gate`` recovers at least 30% of the measured idle rank-time with the
foreground slowed at most 10%; ``net gain`` is against the foreground alone.
The machine's load (other processes) takes CPU from both sides: read every
figure beside its load average. ``--write-docs`` writes the table into
``docs/performance.md`` (region ``multiplex``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
FOREGROUND = REPO / "examples" / "dlrm.py"
BACKGROUND = REPO / "examples" / "background_mlp.py"
GPUS = 2


@dataclass(frozen=True, kw_only=True)
class Run:
    load_before: float
    load_after: float
    figures: dict


def deeppool(*args: str) -> None:
    """The ``deeppool`` command itself (the public path), failing loudly."""
    done = subprocess.run([sys.executable, "-m", "deeppool.cli", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"deeppool {' '.join(args)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def make_plan(args: argparse.Namespace) -> Path:
    path = args.out / "plan.json"
    pins = [item for pin in args.pin for item in ("--pin", pin)]
    deeppool("plan", str(args.model), "--gpus", str(GPUS), "--batch", str(args.batch), "--objective", args.objective,
             "--device-model", args.device_model, "--cache-dir", str(args.out / "cache"), *pins, "--out", str(path))
    return path


def measure(plan: Path, args: argparse.Namespace, index: int) -> Run:
    out = args.out / f"run-{index}"
    before = os.getloadavg()[0]
    deeppool("run", str(plan), "--nproc", str(GPUS), "--steps", str(args.steps), "--background", str(BACKGROUND),
             "--bg-batch", str(args.bg_batch), "--mux", args.mux, "--out", str(out))
    figures = json.loads((out / "summary.json").read_text())["multiplex"]
    return Run(load_before=before, load_after=os.getloadavg()[0], figures=figures)


def table(runs: list[Run], title: str) -> Table:
    shown = Table(title=title)
    columns = ("run", "load avg before/after", "fg alone ms", "fg shared ms", "fg slowdown", "idle rank-ms/it",
               "recovered", "taken from fg rank-ms/it", "bg samples/s", "net gain")
    for column in columns:
        shown.add_column(column, justify="left" if column == "run" else "right")

    def row(name: str, load: str, f: dict) -> None:
        recovered = f["recovered_fraction"]
        shown.add_row(name, load, f"{f['fg_alone_ms']:.1f}", f"{f['fg_shared_ms']:.1f}",
                      f"{100 * f['fg_slowdown']:+.1f}%", f"{f['idle_rank_ms_per_iteration']:.1f}",
                      "-" if recovered is None else f"{100 * recovered:.0f}%",
                      f"{f['fg_taken_ms_per_iteration']:+.1f}", f"{f['bg_samples_per_s']:.0f}", f"{f['net_gain']:.3f}x")

    for i, run in enumerate(runs, 1):
        row(str(i), f"{run.load_before:.1f} / {run.load_after:.1f}", run.figures)
    keys = ("fg_alone_ms", "fg_shared_ms", "fg_slowdown", "idle_rank_ms_per_iteration", "fg_taken_ms_per_iteration",
            "bg_samples_per_s", "net_gain")
    middle = {key: statistics.median(run.figures[key] for run in runs) for key in keys}
    shares = [run.figures["recovered_fraction"] for run in runs if run.figures["recovered_fraction"] is not None]
    middle["recovered_fraction"] = statistics.median(shares) if shares else None
    loads = f"{statistics.median(r.load_before for r in runs):.1f} / {statistics.median(r.load_after for r in runs):.1f}"
    row("median of each column", loads, middle)
    return shown


def layout(plan: dict) -> str:
    """The plan's layers by GPU count, and the ranks that run no layer."""
    counts: dict[int, int] = {}
    for layer in plan["layers"]:
        counts[layer["gpus"]] = counts.get(layer["gpus"], 0) + 1
    widest = max(counts)
    parts = [f"{n} layers on {g} GPU{'s' if g > 1 else ''}" for g, n in sorted(counts.items())]
    idle = f"; ranks {list(range(widest, plan['gpus']))} run no layer" if widest < plan["gpus"] else ""
    return ", ".join(parts) + idle


def prediction(plan: dict) -> str:
    """What the planner predicted for the plan: its iteration and, for a cluster plan, the two shares."""
    line = f"planned: iteration {plan['predicted']['iteration_ms']:.1f} ms ({plan['device']})"
    cluster = plan.get("cluster")
    if cluster:
        line += (f"; cluster throughput {cluster['fg_share'] + cluster['bg_share']:.3f}x data parallel on all "
                 f"{plan['gpus']} = foreground share {cluster['fg_share']:.3f} + background share "
                 f"{cluster['bg_share']:.3f} (lends {100 * cluster['lent_fraction']:.0f}% of rank-time, "
                 f"efficiencies: {cluster['interference']})")
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=35)
    parser.add_argument("--model", type=Path, default=FOREGROUND, help="the foreground's model file")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--bg-batch", type=int, default=8)
    parser.add_argument("--mux", default="gate")
    parser.add_argument("--objective", default="cluster", help="passed to `deeppool plan --objective`")
    parser.add_argument("--pin", action="append", default=[], help="GLOB=N, passed to `deeppool plan --pin`")
    parser.add_argument("--device-model", default="local", help="local (measured here) or a GPU model")
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--write-docs", action="store_true",
                        help="also write the table into docs/performance.md (region 'multiplex')")
    args = parser.parse_args()
    from deeppool.docregions import Stamp, markdown, write_region

    stamp = Stamp.started()
    args.out = args.out or Path(tempfile.mkdtemp(prefix="deeppool-mux-bench-"))
    args.out.mkdir(parents=True, exist_ok=True)
    plan_path = make_plan(args)
    plan = json.loads(plan_path.read_text())
    runs = [measure(plan_path, args, i) for i in range(1, args.runs + 1)]
    title = (f"{args.model.name} on {GPUS} ranks, batch {args.batch}, --objective {args.objective}"
             f"{''.join(f' --pin {p}' for p in args.pin)} ({layout(plan)}); background {BACKGROUND.name}, "
             f"--mux {args.mux}, {args.steps} steps")
    shown = table(runs, title)
    Console(width=200).print(shown)
    print(prediction(plan))
    if args.write_docs:
        write_region(REPO / "docs" / "performance.md", "multiplex", f"{markdown(shown)}\n\n{prediction(plan)}", stamp)


if __name__ == "__main__":
    main()
