"""K-FAC against first-order optimizers, its overhead by part, and the planner's price of it.

    python benchmarks/kfac.py [--max-steps 400] [--fidelity-steps 40] [--fidelity-runs 3]
                              [--parts convergence overhead fidelity] [--write-docs]

**Convergence.** Two synthetic tasks whose optimum is known, trained on one process with mini-batches of 64
in a seeded order, by SGD with momentum 0.9, AdamW and K-FAC (the same SGD, its gradients preconditioned by
:mod:`deeppool.adaptation.kfac`; damping 0.03, factors every step, eigendecompositions every 10, KL clip
0.01): each optimizer at each learning rate of a small grid, and the best rate reported (fewest steps to the
target, its wall time):

* ``regression``: ``y = X w* + ε`` in 32 dimensions, ``X`` with a covariance of condition number 10⁴ (a
  random rotation of eigenvalues from 10⁻² to 10²), ``σ_ε = 0.1``, 2,048 samples; a ``Linear(32, 1)`` with
  the loss ``½(y − ŷ)²``, whose optimum on the training set is least squares' (computed exactly; the
  initial loss is about 10⁵ times it). Target: 20 times that optimum.
* ``teacher``: labels are a random teacher MLP's classes (10) on 2,048 inputs in 32 dimensions with feature
  scales from 0.1 to 10; the student is a 32-128-128-10 ReLU MLP with cross entropy. The task is
  realisable, so the optimum is 0. Target: training loss 0.5 (from 2.35).

**Overhead.** The teacher student widened to 512-512, batch 256: the median step of SGD and of K-FAC
split into its parts (the statistics the hooks gather in the forward and backward, the factor update, the
eigendecompositions amortised over their interval, the preconditioning with KL clipping).

**Fidelity.** ``deeppool plan benchmarks/models/kfac_mlp.py --batch 64 --optimizer kfac --no-cache`` (measured
here, K-FAC's work timed by the preconditioner itself, :mod:`deeppool.planner.profiling.kfac_times`) against
``deeppool run plan.json --optimizer kfac``'s mean iteration over ``--fidelity-steps`` (the
eigendecompositions every 10 steps included), and the same for SGD right after: the predicted and measured
iteration and K-FAC's share of it (goal: within ±15%). Two settings: one rank (``--gpus 1``), and two ranks
with every layer on both (``--gpus 2 --strategy dp``: each layer's factors all-reduced, its
eigendecompositions on one of the two, round-robin, and its preconditioned gradient sent to the other).
Plan and run get one intra-op thread a rank (``OMP_NUM_THREADS``, unless set); the whole comparison is
repeated ``--fidelity-runs`` times, each row with the load average when its plans started, since other
processes' load moves both the plan-time timings and the run between minutes.

``--write-docs`` (all three parts) writes the tables into ``docs/adaptation.md`` (region ``kfac``) and
``docs/performance.md`` (region ``kfac``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch import nn
from torch.nn import functional

from deeppool.adaptation.kfac import KFACPreconditioner
from deeppool.adaptation.kfac_options import KfacOptions
from deeppool.docregions import REPO, Stamp, markdown, write_region

BATCH = 64
PARTS = ("convergence", "overhead", "fidelity")
SETTINGS = {"1 rank": ("--gpus", "1"), "2 ranks, every layer on both": ("--gpus", "2", "--strategy", "dp")}
"""Fidelity's settings: their label and ``deeppool plan``'s options."""
GOAL = 0.15
OPTIONS = KfacOptions(damping=0.03, factor_update_steps=1, inv_update_steps=10, kl_clip=0.01)
GRIDS = {"SGD+momentum": (0.001, 0.01, 0.1), "AdamW": (0.001, 0.01, 0.1), "K-FAC": (0.03, 0.1, 0.3)}


@dataclass(frozen=True)
class Task:
    name: str
    x: torch.Tensor
    y: torch.Tensor
    make: Callable[[], nn.Module]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    target: float
    optimum: float


@dataclass(frozen=True)
class Outcome:
    optimizer: str
    lr: float
    steps: int | None
    seconds: float
    final: float


def regression() -> Task:
    gen = torch.Generator().manual_seed(0)
    rotation, _ = torch.linalg.qr(torch.randn(32, 32, generator=gen))
    scales = torch.logspace(-1, 1, 32)  # standard deviations 0.1..10: covariance eigenvalues 1e-2..1e2
    x = torch.randn(2048, 32, generator=gen) * scales @ rotation.T
    w = torch.randn(32, 1, generator=gen)
    y = x @ w + 0.1 * torch.randn(2048, 1, generator=gen)
    ones = torch.cat([x, torch.ones(2048, 1)], dim=1)
    best = torch.linalg.lstsq(ones.double(), y.double()).solution
    optimum = float(0.5 * ((ones.double() @ best - y.double()) ** 2).mean())

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return 0.5 * ((out - target) ** 2).sum(dim=1).mean()

    return Task("regression", x, y, lambda: nn.Linear(32, 1), loss, target=20 * optimum, optimum=optimum)


def _mlp(width: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))


def teacher() -> Task:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 32, generator=gen) * torch.logspace(-1, 1, 32)
    with torch.no_grad():
        y = _mlp(64, seed=2)(x).argmax(dim=1)
    return Task("teacher", x, y, lambda: _mlp(128, seed=3), functional.cross_entropy, target=0.5, optimum=0.0)


def train(task: Task, optimizer: str, lr: float, max_steps: int) -> Outcome:
    torch.manual_seed(4)
    model = task.make()
    opt: torch.optim.Optimizer
    if optimizer == "AdamW":
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    kfac = KFACPreconditioner(model, OPTIONS, lr=lr) if optimizer == "K-FAC" else None
    order = torch.Generator().manual_seed(5)
    batches = math.ceil(len(task.x) / BATCH)
    seconds, step = 0.0, 0
    while step < max_steps:
        permutation = torch.randperm(len(task.x), generator=order)
        for index in range(batches):
            rows = permutation[index * BATCH:(index + 1) * BATCH]
            started = time.perf_counter()
            opt.zero_grad()
            task.loss(model(task.x[rows]), task.y[rows]).backward()
            if kfac is not None:
                kfac.step()
            opt.step()
            seconds += time.perf_counter() - started
            step += 1
            with torch.no_grad():
                whole = float(task.loss(model(task.x), task.y))
            if not math.isfinite(whole):
                return Outcome(optimizer, lr, None, seconds, whole)
            if whole <= task.target:
                return Outcome(optimizer, lr, step, seconds, whole)
            if step == max_steps:
                break
    return Outcome(optimizer, lr, None, seconds, whole)


def convergence(max_steps: int) -> Table:
    table = Table(title="Steps and wall time to the target loss (best learning rate of the grid)")
    for column in ("task", "target", "optimizer", "best lr", "steps", "seconds", "ms/step", "loss at the end",
                   "reached by"):
        table.add_column(column)
    for task in (regression(), teacher()):
        for optimizer, grid in GRIDS.items():
            outcomes = [train(task, optimizer, lr, max_steps) for lr in grid]
            reached = [o for o in outcomes if o.steps is not None]
            best = min(reached, key=lambda o: o.steps) if reached else min(outcomes, key=lambda o: o.final)
            steps = "-" if best.steps is None else str(best.steps)
            per_step = best.seconds / (best.steps or max_steps) * 1e3
            table.add_row(task.name, f"{task.target:.4g}", optimizer, f"{best.lr:g}", steps,
                          f"{best.seconds:.2f}", f"{per_step:.2f}", f"{best.final:.4g}",
                          f"{len(reached)}/{len(grid)} rates")
    table.caption = (f"Not reached ('-'): the rate with the lowest loss after {max_steps} steps. Regression's "
                     "target is 20x the least-squares optimum; the teacher task's optimum is 0.")
    return table


def overhead(repeats: int = 30) -> Table:
    x = torch.randn(256, 32, generator=torch.Generator().manual_seed(6))
    y = torch.randint(0, 10, (256,), generator=torch.Generator().manual_seed(7))
    parts: dict[str, list[float]] = {name: [] for name in ("SGD step", "K-FAC step", "SGD passes", "K-FAC passes",
                                                           "factors", "inverses", "precondition")}
    for use_kfac in (False, True):
        model = _mlp(512, seed=8)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        kfac = KFACPreconditioner(model, OPTIONS, lr=0.01) if use_kfac else None
        label = "K-FAC" if use_kfac else "SGD"
        for index in range(repeats + 2):
            started = time.perf_counter()
            opt.zero_grad()
            functional.cross_entropy(model(x), y).backward()
            passes = time.perf_counter() - started
            if kfac is not None:
                kfac.step()
            opt.step()
            if index < 2:
                continue
            parts[f"{label} step"].append(time.perf_counter() - started)
            parts[f"{label} passes"].append(passes)
            for name, seconds in (kfac.last_step_s.items() if kfac is not None else ()):
                parts[name].append(seconds)
    plain = statistics.median(parts["SGD step"])
    found = {"SGD step": plain, "K-FAC step": statistics.median(parts["K-FAC step"]),
             "statistics (the hooks in forward and backward)":
                 statistics.median(parts["K-FAC passes"]) - statistics.median(parts["SGD passes"]),
             "factor update": statistics.median(parts["factors"]),
             "eigendecompositions (mean: every 10th step)": statistics.mean(parts["inverses"]),
             "preconditioning + KL clip": statistics.median(parts["precondition"])}
    table = Table(title="K-FAC's per-step overhead by part (MLP 32-512-512-10, batch 256, one process, one thread)")
    for column in ("part", "ms per step", "of SGD's step"):
        table.add_column(column)
    for name, value in found.items():
        table.add_row(name, f"{value * 1e3:.2f}", f"{value / plain:.2f}x")
    table.caption = "Medians of 30 steps (the eigendecompositions: their mean, so amortised over 10 steps)."
    return table


def _deeppool(*args: str, cwd: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # the planner times with $OMP_NUM_THREADS threads, as many as each rank of the run gets
    done = subprocess.run([sys.executable, "-m", "deeppool.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit(f"deeppool {' '.join(args)} failed:\n{done.stderr[-2000:]}")


def _measured_ms(out: Path) -> float:
    rows = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    return statistics.mean(row["iteration_ms"] for row in rows[10:])


@dataclass(frozen=True)
class Compared:
    """One setting's predicted and measured iterations (ms), SGD's and K-FAC's, and the load when it ran."""

    setting: str
    load: float
    sgd: tuple[float, float]
    kfac: tuple[float, float]

    @property
    def share(self) -> tuple[float, float]:
        """K-FAC's share of the iteration (``kfac - sgd``): predicted, measured."""
        return self.kfac[0] - self.sgd[0], self.kfac[1] - self.sgd[1]

    @property
    def within(self) -> bool:
        predicted, measured = self.share
        return abs(measured / predicted - 1) <= GOAL


def _compare(setting: str, options: tuple[str, ...], steps: int, where: Path) -> Compared:
    model = REPO / "benchmarks" / "models" / "kfac_mlp.py"
    found: dict[str, tuple[float, float]] = {}
    load = os.getloadavg()[0]
    for optimizer in ("kfac", "sgd"):
        _deeppool("plan", str(model), *options, "--batch", str(BATCH), "--optimizer", optimizer, "--no-cache",
                  "--out", f"{optimizer}.json", cwd=where)
        plan = json.loads((where / f"{optimizer}.json").read_text())
        ranks = str(max(layer["gpus"] for layer in plan["layers"]))
        _deeppool("run", f"{optimizer}.json", "--nproc", ranks, "--steps", str(steps + 10), "--optimizer", optimizer,
                  "--out", optimizer, cwd=where)
        found[optimizer] = (plan["predicted"]["iteration_ms"], _measured_ms(where / optimizer))
    return Compared(setting=setting, load=load, sgd=found["sgd"], kfac=found["kfac"])


def fidelity(steps: int, runs: int) -> Table:
    compared: list[Compared] = []
    for _ in range(runs):
        for setting, options in SETTINGS.items():
            with tempfile.TemporaryDirectory() as folder:
                compared.append(_compare(setting, options, steps, Path(folder)))
    table = Table(title=f"The planner's price of K-FAC against measured runs (kfac_mlp, batch {BATCH})")
    for column in ("run", "setting", "load average", "sgd predicted / measured ms", "kfac predicted / measured ms",
                   "K-FAC's share predicted ms", "measured ms", "measured/predicted"):
        table.add_column(column)
    for index, row in enumerate(compared):
        (sgd_p, sgd_m), (kfac_p, kfac_m), (share_p, share_m) = row.sgd, row.kfac, row.share
        table.add_row(str(index // len(SETTINGS) + 1), row.setting, f"{row.load:.1f}", f"{sgd_p:.2f} / {sgd_m:.2f}",
                      f"{kfac_p:.2f} / {kfac_m:.2f}", f"{share_p:.2f}", f"{share_m:.2f}", f"{share_m / share_p:.2f}")
    hits = {setting: sum(row.within for row in compared if row.setting == setting) for setting in SETTINGS}
    table.caption = (f"Measured: the mean iteration of steps 10..{steps + 9} (eigendecompositions every 10 steps "
                     f"included); the load average (1 minute) when the setting's plans started, on {os.cpu_count()} "
                     f"cores. K-FAC's share within ±{GOAL:.0%} (the goal): "
                     + ", ".join(f"{setting} in {hit} of {runs} runs" for setting, hit in hits.items()) + ".")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--fidelity-steps", type=int, default=40)
    parser.add_argument("--fidelity-runs", type=int, default=3, help="times the fidelity comparison is repeated")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--write-docs", action="store_true", help="write the regions (all three parts)")
    args = parser.parse_args()
    if args.write_docs and set(args.parts) != set(PARTS):
        parser.error("--write-docs writes all three parts: leave out --parts")
    torch.set_num_threads(1)
    stamp = Stamp.started()
    console = Console(width=140)
    build = {"convergence": lambda: convergence(args.max_steps), "overhead": overhead,
             "fidelity": lambda: fidelity(args.fidelity_steps, args.fidelity_runs)}
    tables = [build[part]() for part in PARTS if part in args.parts]
    for table in tables:
        console.print(table)
    if args.write_docs:
        body = "\n\n".join(markdown(table) for table in tables)
        for doc in ("adaptation.md", "performance.md"):
            write_region(REPO / "docs" / doc, "kfac", body, stamp)


if __name__ == "__main__":
    main()
