"""Fidelity: measured over predicted iteration time of burst plans, on this machine.

    python benchmarks/fidelity.py [--nproc 2,4] [--models cnn,branching_cnn,transformer,mlp]
                                  [--batch 32] [--steps 30] [--warmup 10] [--scatter fidelity.png]
    python benchmarks/fidelity.py --zoo [--runs 3] [--nproc 2,4] [--models hf_resnet,...] [--batch 32]
                                  [--steps 30] [--replay] [--write-docs]

``--zoo``: held-out models (``benchmarks/zoo``: HF transformers ResNet, ConvNeXt, ViT and BERT built from
their configs, a VGG-style and a MobileNetV2-style CNN), which the cost model was not tuned on, each on 2
and 4 gloo ranks, with the ``deeppool`` commands as a user types them, default flags: ``deeppool plan MODEL
--gpus N --batch B`` (measured here, the network too: its default cache keeps the layer times and the network
probed for each rank count from run to run, as a user's does; a fresh home folder keeps other caches out) and
``deeppool run plan.json --steps S``. Every run of ``--runs`` records each row's
measured/predicted, the load average around it, the other work on the machine during it (tasks runnable
outside the benchmark's own processes, sampled from /proc: the load average counts the row's own ranks), the
host's speed before the plan and after the run (the profiler's reference work), the plan's uncertainty and
every stage's measured/predicted (the per-stage scatter). Goal: every row within ±15%
on a quiet machine (other work ≤ a quarter of the cores), in three runs in a row. ``--replay`` runs every
row's plan once more after the set, so that a row's miss can be told apart: the same plan's run moving from
minute to minute, or its prediction moving from one plan of the model to the next.

For every model of ``benchmarks/models`` (a CNN, a branching CNN, a
transformer, an MLP) and every rank count: the network is measured here with
gloo (``deeppool profile-network``), the model is profiled here (the local
profiler at every per-GPU batch the plan may use, one rank's share of the
cores), and a *burst* plan is made, one with at least two distinct GPU counts:
the ILP's time-optimal plan when it is burst, else the ILP under DeepPool's
objective ``time + price · GPU-time`` at the cheapest price in a sweep that
gives a burst plan, else (where the ILP puts every layer on one count at every
price, as when ranks share cores) the fastest plan, by the cost model, that runs
one contiguous run of layers on all ranks and the rest on one. The plan runs through the executor (gloo, the default
25 MiB gradient buckets) and the measured median iteration time is divided by
the predicted one (goal: within ±15%). A PNG scatters every stage's measured
against predicted forward+backward time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from deeppool.docregions import REPO, Stamp, teed_stdout, text_block, write_region
from deeppool.planner.profiling.hostload import runnable_outside

MODELS = Path(__file__).resolve().parent / "models"
ZOO = Path(__file__).resolve().parent / "zoo"
ZOO_MODELS = "hf_resnet,hf_convnext,hf_vit,hf_bert,vgg_small,mobilenet_small"
QUIET_SHARE = 0.25
"""The zoo's goal holds where other work (every task outside the benchmark's own processes) kept on average
at most this share of the cores runnable during the row (:class:`OtherWork`); the load average cannot say
so, since a row's own ranks raise it (4 ranks on 2 cores read 2.5 on an idle machine)."""
PRICE_FACTORS = (0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)
TERMS = ("compute", "reshard", "allreduce", "step")
"""The terms an iteration is split into: span labels ``term:...`` (``forward``/``backward`` and the
loss are compute, ``optimizer`` is the step); rank 0, which runs every layer, is the one split."""


@dataclass(frozen=True, kw_only=True)
class Result:
    model: str
    nproc: int
    counts: tuple[int, ...]
    how: str
    predicted_ms: float
    measured_ms: float
    stages: tuple[tuple[str, float, float], ...]
    """(stage, predicted, measured forward+backward ms) for each stage of the run."""
    terms: dict[str, tuple[float, float]]
    """(predicted, measured) ms per term of :data:`TERMS` on rank 0."""
    contention: float
    """:func:`contention` at ``nproc`` just before the run."""

    @property
    def ratio(self) -> float:
        return self.measured_ms / self.predicted_ms

    @property
    def compute(self) -> tuple[float, float]:
        """(predicted, measured) forward+backward ms summed over the stages."""
        return sum(p for _, p, _ in self.stages), sum(m for _, _, m in self.stages)

    @property
    def rest(self) -> tuple[float, float]:
        """(predicted, measured) ms outside the stages' forward and backward: reshards, loss,
        gradient all-reduce, optimizer step and the executor's own work."""
        predicted, measured = self.compute
        return self.predicted_ms - predicted, self.measured_ms - measured


def _timed_work(start: Any, results: Any) -> None:
    """One single-thread process: a fixed number of 256×256 matmuls, timed after every process is ready."""
    import time

    import torch

    torch.set_num_threads(1)
    matrix = torch.randn(256, 256)
    start.wait()
    began = time.perf_counter()
    for _ in range(400):
        matrix @ matrix
    results.put(time.perf_counter() - began)


def contention(nproc: int) -> float:
    """How much slower ``nproc`` single-thread processes computing at once run than one alone, now:
    the slowest one's time for the same work over the lone one's. On an idle host with a core per rank
    it is about 1; what it exceeds that by is what other work on the host (or shared cores) stretches
    a run that the profile, measured one process at a time, does not see."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")

    def run(count: int) -> float:
        start, results = context.Barrier(count), context.SimpleQueue()
        processes = [context.Process(target=_timed_work, args=(start, results)) for _ in range(count)]
        for process in processes:
            process.start()
        times = [results.get() for _ in processes]
        for process in processes:
            process.join()
        return max(times)

    return run(nproc) / run(1)


def measure_network(nproc: int, path: Path) -> None:
    from deeppool.planner.profiling.netprobe import probe_network
    from deeppool.planner.profiling.netprobe_config import ProbeConfig

    probe_network(ProbeConfig(nproc=nproc)).save(path)


def burst_plan(model: Path, nproc: int, batch: int, network: Path, cache: Path, out: Path) -> str:
    """Write a plan with at least two distinct GPU counts to ``out``; say how it was found."""
    from deeppool.plans import ModelSpec, Objective
    from deeppool.planner.api import CostSource, PlanRequest, plan_model

    spec = ModelSpec.parse(str(model))
    request = PlanRequest(gpus=nproc, global_batch=batch)
    source = CostSource(device_model="local", network_file=network, cache_dir=cache, show_progress=False)
    planned = plan_model(spec, request, source)  # measures every per-GPU batch the plan and its baselines use
    if len(set(planned.plan.assignment.values())) > 1:
        planned.plan.save(out)
        return "ILP, time"
    unit = planned.plan.predicted.iteration_ms / planned.plan.predicted.gpu_seconds_per_iteration
    for factor in PRICE_FACTORS:
        priced = replace(request, objective=Objective.TIME_AND_GPU_TIME, price=factor * unit)
        plan = plan_model(spec, priced, source).plan  # its own batches measured too (the rest from the cache)
        if len(set(plan.assignment.values())) > 1:
            plan.save(out)
            return f"ILP, time + {factor:g}x price"
    split_burst(planned, nproc).save(out)
    return "best split: 1 and all ranks"


def split_burst(planned: Any, nproc: int) -> Any:
    """The burst plan the cost model prices fastest among those that run one contiguous run of
    layers (in topological order) on all ``nproc`` ranks and the others on one: for a machine where
    the ILP puts every layer on one count at every price (e.g. ranks that share their cores)."""
    from deeppool.planner.solve.baselines import Baselines
    from deeppool.planner.solve.build import build_plan

    cost, plan = planned.cost, planned.plan
    names = [layer.name for layer in cost.graph.layers]
    splits = [{name: nproc if first <= i <= last else 1 for i, name in enumerate(names)}
              for first in range(len(names)) for last in range(first, len(names))]
    splits = [a for a in splits if len(set(a.values())) > 1]
    best = min(splits, key=cost.iteration_ms)
    predicted = plan.predicted
    baselines = Baselines(data_parallel_ms=predicted.data_parallel_iteration_ms,
                          deeppool_ms=predicted.deeppool_iteration_ms,
                          best_data_parallel_gpus=predicted.best_data_parallel_gpus,
                          best_data_parallel_ms=predicted.best_data_parallel_iteration_ms)
    return build_plan(cost, best, model=plan.model, gpus=nproc, strategy=plan.strategy,
                      amplification_limit=plan.amplification_limit, solver=plan.solver, baselines=baselines)


def run_plan(plan: Path, nproc: int, steps: int, warmup: int, out: Path) -> dict:
    from deeppool.executor.engine.comm import Backend
    from deeppool.executor.config import OptimizerConfig, RunConfig
    from deeppool.executor.launch.launch import launch
    from deeppool.plans import Optimizer, Plan

    config = RunConfig(steps=steps, warmup=warmup, optimizer=OptimizerConfig(kind=Optimizer.SGD, lr=0.01, momentum=0.0),
                       backend=Backend.AUTO, timeout_s=300.0, bucket_mb=25.0, check_bound=1e-5, out_dir=out)
    launch(Plan.load(plan), plan, nproc=nproc, config=config)
    return json.loads((out / "summary.json").read_text())


def terms(plan: Path, run: Path, warmup: int) -> dict[str, tuple[float, float]]:
    predicted, measured = predicted_terms(plan), measured_terms(run, warmup)
    return {term: (predicted.get(term, 0.0), measured.get(term, 0.0)) for term in dict.fromkeys((*TERMS, *measured))}


def term_of(label: str) -> str:
    kind = label.split(":", 1)[0]
    return {"forward": "compute", "backward": "compute", "loss": "compute", "optimizer": "step",
            "syncbn": "syncbn (within compute)"}.get(kind, kind)


def measured_terms(run: Path, warmup: int) -> dict[str, float]:
    """Rank 0's median per-step ms of each term, from its trace (idle windows left out; a step
    without a term counts 0 for it)."""
    events = json.loads((run / "trace-rank0.json").read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and e["args"]["step"] >= warmup and e["cat"] in ("compute", "comm")]
    steps = sorted({e["args"]["step"] for e in spans})
    per_step: dict[str, dict[int, float]] = {term: dict.fromkeys(steps, 0.0) for term in TERMS}
    for event in spans:
        by_step = per_step.setdefault(term_of(event["name"]), dict.fromkeys(steps, 0.0))
        by_step[event["args"]["step"]] += event["dur"] / 1e3
    return {term: statistics.median(by_step.values()) if by_step else 0.0 for term, by_step in per_step.items()}


def predicted_terms(plan: Path) -> dict[str, float]:
    """The plan's figures by term; reshards are what the iteration has beyond its layers' terms."""
    payload = json.loads(plan.read_text())
    layers, predicted = payload["layers"], payload["predicted"]
    terms = {"compute": sum(l["fwd_ms"] + l["bwd_ms"] for l in layers),
             "allreduce": sum(l["allreduce_ms"] for l in layers),
             "step": sum(l["step_ms"] for l in layers) + predicted.get("step_call_ms", 0.0)}
    terms["reshard"] = predicted["iteration_ms"] - sum(terms.values())
    return terms


def one(model: str, nproc: int, args: argparse.Namespace, work: Path) -> Result:
    from deeppool.plans import Plan

    network = work / f"network-{nproc}.json"
    if not network.is_file():
        measure_network(nproc, network)
    plan_path = work / f"{model}-{nproc}.json"
    how = burst_plan(MODELS / f"{model}.py", nproc, args.batch, network, work / "cache", plan_path)
    slowdown = contention(nproc)
    summary = run_plan(plan_path, nproc, args.steps, args.warmup, work / f"{model}-{nproc}")
    stages = tuple((s["name"], s["fwd_predicted"] + s["bwd_predicted"], s["fwd_measured"] + s["bwd_measured"])
                   for s in summary["stages"])
    return Result(model=model, nproc=nproc, counts=tuple(sorted(set(Plan.load(plan_path).assignment.values()))),
                  how=how, predicted_ms=summary["iteration_predicted_ms"],
                  measured_ms=summary["iteration_measured_ms"], stages=stages,
                  terms=terms(plan_path, work / f"{model}-{nproc}", args.warmup), contention=slowdown)


def scatter(results: list[Result], path: Path) -> None:
    plot_stages([(f"{r.model}, {r.nproc} ranks", r.stages) for r in results], path,
                "per-stage fidelity of the cost model on this machine")


def plot_stages(series: list[tuple[str, tuple[tuple[str, float, float], ...]]], path: Path, title: str) -> None:
    """Every stage's measured against predicted forward+backward ms, one colour per label (series with the same
    label, such as one row's runs, share it), the legend beside the axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(9.5, 6))
    points = [(p, m) for _, stages in series for _, p, m in stages if p > 0 and m > 0]
    merged: dict[str, list[tuple[float, float]]] = {}
    for label, stages in series:
        merged.setdefault(label, []).extend((p, m) for _, p, m in stages if p > 0 and m > 0)
    colours = plt.cm.tab20.colors if len(merged) > 10 else plt.cm.tab10.colors
    for index, (label, mine) in enumerate(merged.items()):
        axes.scatter([p for p, _ in mine], [m for _, m in mine], s=14, alpha=0.7, label=label,
                     color=colours[index % len(colours)])
    low, high = min(min(p, m) for p, m in points), max(max(p, m) for p, m in points)
    axes.plot([low, high], [low, high], "k-", linewidth=1, label="measured = predicted")
    axes.fill_between([low, high], [0.85 * low, 0.85 * high], [1.15 * low, 1.15 * high], color="grey", alpha=0.2,
                      label="±15%")
    axes.set_xscale("log")
    axes.set_yscale("log")
    within_decade = high / max(low, 1e-9) < 10  # label the minor ticks only where the major ones are few
    for axis in (axes.xaxis, axes.yaxis):
        axis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        axis.set_minor_formatter(matplotlib.ticker.ScalarFormatter() if within_decade
                                 else matplotlib.ticker.NullFormatter())
    axes.set_xlabel("predicted forward+backward ms per stage")
    axes.set_ylabel("measured ms (median, slowest rank)")
    axes.set_title(title)
    axes.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


@dataclass(frozen=True, kw_only=True)
class ZooRow:
    """One held-out model on ``nproc`` ranks in one run, planned and run with the default flags."""

    run: int
    model: str
    nproc: int
    counts: tuple[int, ...]
    predicted_ms: float
    measured_ms: float
    uncertainty: float
    busy_layers: int
    stages: tuple[tuple[str, float, float], ...]
    """(stage, predicted, measured forward+backward ms) for each stage of the run."""
    spreads: tuple[float, ...]
    """Each stage's confidence in the plan: the spread of the measurements it rests on."""
    load_before: float
    load_after: float
    other_work: float
    """Tasks outside the benchmark's process tree runnable at once, on average over the row."""
    reference_before: float
    reference_after: float
    """The host's speed before the plan and after the run: the profiler's reference work in ms, one thread."""
    shared: int
    """The most ranks of a stage (the cores' sharing below is for that many; 1: none is shared)."""
    sharing_planned: float
    """How much slower ``shared`` ranks computing at once ran than one, as the plan's profile measured it."""
    sharing_run: float
    """The same just before the run (:func:`contention`)."""
    replayed_ms: float | None = None
    """With ``--replay``: the same plan's measured iteration when run again after every run of the set."""

    @property
    def ratio(self) -> float:
        return self.measured_ms / self.predicted_ms

    @property
    def drift(self) -> float | None:
        """The replay's iteration over the first run's: how far the same plan's run moved, minutes later."""
        return None if self.replayed_ms is None else self.replayed_ms / self.measured_ms

    def replay_line(self) -> str:
        ratio = (self.replayed_ms or 0.0) / self.predicted_ms
        return (f"replay of run {self.run}  {self.model:<16} {self.nproc} ranks  counts {list(self.counts)!s:<8} "
                f"measured {self.measured_ms:8.2f} ms then, {self.replayed_ms:8.2f} ms now ({self.drift:.2f}x); "
                f"measured/predicted {self.ratio:.2f} then, {ratio:.2f} now{'' if abs(ratio - 1) <= 0.15 else ' (miss)'}")

    @property
    def within(self) -> bool:
        return abs(self.ratio - 1) <= 0.15

    @property
    def quiet(self) -> bool:
        return self.other_work <= QUIET_SHARE * (os.cpu_count() or 1)

    def line(self) -> str:
        ratios = ", ".join(f"{m / p:.2f}±{100 * s:.0f}%" if p > 0 else "-"
                           for (_, p, m), s in zip(self.stages, self.spreads, strict=True))
        return (f"run {self.run}  {self.model:<16} {self.nproc} ranks  counts {list(self.counts)!s:<8} "
                f"predicted {self.predicted_ms:8.2f} ms ±{100 * self.uncertainty:.0f}%  measured "
                f"{self.measured_ms:8.2f} ms  measured/predicted {self.ratio:.2f}{'' if self.within else ' (miss)'}  "
                f"load {self.load_before:.2f} → {self.load_after:.2f}, other work {self.other_work:.2f} runnable "
                f"({'quiet' if self.quiet else 'busy'}); host reference {self.reference_before:.1f} → "
                f"{self.reference_after:.1f} ms; {self.shared} ranks at once "
                f"{self._sharing}; busy-measured layers {self.busy_layers}; "
                f"stages measured/predicted (±their spread): {ratios}")

    @property
    def _sharing(self) -> str:
        if self.shared == 1:
            return "(no stage shares the cores)"
        return f"{self.sharing_planned:.2f}x slower at the plan, {self.sharing_run:.2f}x at the run"


def deeppool(*args: str, cwd: Path, home: Path) -> None:
    """One ``deeppool`` command as a user types it, in ``cwd``, with ``home`` as its home folder."""
    import subprocess
    import sys

    env = {**os.environ, "HOME": str(home)}
    done = subprocess.run([sys.executable, "-m", "deeppool.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"error: deeppool {' '.join(args)} failed ({done.returncode}):\n{done.stderr[-2000:]}")


def zoo_row(run: int, model: str, nproc: int, args: argparse.Namespace, work: Path) -> ZooRow:
    from deeppool.plans import Plan
    from deeppool.planner.report import ReportStage

    row = work / f"run{run}" / f"{model}-{nproc}"
    row.mkdir(parents=True)
    home = work / "home"
    load_before = os.getloadavg()[0]
    reference_before = host_reference()
    with OtherWork() as other:
        deeppool("plan", str(ZOO / f"{model}.py"), "--gpus", str(nproc), "--batch", str(args.batch),
                 "--out", "plan.json", cwd=row, home=home)
        plan = Plan.load(row / "plan.json")
        shared = max(plan.assignment.values())
        sharing_run = contention(shared) if shared > 1 else 1.0
        deeppool("run", "plan.json", "--steps", str(args.steps), cwd=row, home=home)
    summary = json.loads((row / "deeppool-run" / "summary.json").read_text())
    planned = {layer.name: layer for layer in plan.layers}
    stages = tuple((stage["name"], stage["fwd_predicted"] + stage["bwd_predicted"],
                    stage["fwd_measured"] + stage["bwd_measured"]) for stage in summary["stages"])
    spreads = tuple(ReportStage(tuple(planned[name] for name in stage["layers"])).spread for stage in summary["stages"])
    return ZooRow(run=run, model=model, nproc=nproc, counts=tuple(sorted(set(plan.assignment.values()))),
                  predicted_ms=summary["iteration_predicted_ms"], measured_ms=summary["iteration_measured_ms"],
                  uncertainty=plan.predicted.uncertainty,
                  busy_layers=len(plan.evidence.busy) if plan.evidence is not None else 0,
                  stages=stages, spreads=spreads, load_before=load_before,
                  load_after=os.getloadavg()[0], other_work=other.mean, reference_before=reference_before,
                  reference_after=host_reference(), shared=shared,
                  sharing_planned=plan.evidence.sharing[shared] if plan.evidence is not None and shared > 1 else 1.0,
                  sharing_run=sharing_run)


def host_reference() -> float:
    """The profiler's reference work (:func:`deeppool.planner.profiling.timing.reference_ms`) on one thread: how fast the
    host is now, so that a row whose plan and run met different speeds shows it."""
    from deeppool.planner.profiling.timing import intra_op_threads, reference_ms

    with intra_op_threads(1):
        return reference_ms()


class OtherWork:
    """While the block runs: the tasks (threads) runnable outside this process's tree, sampled from /proc
    every ``every_s`` seconds (the benchmark's own ranks are its descendants, so they do not count)."""

    def __init__(self, every_s: float = 1.0, proc: Path = Path("/proc")) -> None:
        self._every_s, self._proc = every_s, proc
        self._samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> OtherWork:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mean(self) -> float:
        return statistics.fmean(self._samples) if self._samples else 0.0

    def _sample(self) -> None:
        while True:
            self._samples.append(runnable_outside(os.getpid(), self._proc))
            if self._stop.wait(self._every_s):
                return


def zoo(args: argparse.Namespace) -> None:
    """Every run: each model planned and run at each rank count (see the module)."""
    work = Path(tempfile.mkdtemp(prefix="deeppool-fidelity-zoo-"))
    models = (args.models or ZOO_MODELS).split(",")
    counts = [int(n) for n in args.nproc.split(",")]
    unknown = [model for model in models if not (ZOO / f"{model}.py").is_file()]
    if unknown:
        raise SystemExit(f"error: --models {unknown[0]}: no such held-out model (choose from {ZOO_MODELS})")
    print(f"machine: {os.cpu_count()} CPU cores, load {os.getloadavg()[0]:.2f}; held-out models {models} on "
          f"{counts} gloo ranks; global batch {args.batch}, {args.steps} steps; {args.runs} runs", flush=True)
    rows: list[ZooRow] = []
    for run in range(1, args.runs + 1):
        (work / f"run{run}").mkdir(parents=True)
        for nproc in counts:
            for model in models:
                rows.append(zoo_row(run, model, nproc, args, work))
                print(rows[-1].line(), flush=True)
        mine = [row for row in rows if row.run == run]
        print(f"run {run}: {sum(row.within for row in mine)} of {len(mine)} rows within ±15%, "
              f"{sum(row.quiet for row in mine)} quiet (other work ≤ {QUIET_SHARE:g} of the cores); "
              "median measured/predicted "
              f"{statistics.median(row.ratio for row in mine):.2f}", flush=True)
    if args.replay:
        rows = replay(rows, args, work)
    print(f"goal (every row within ±15% while other work keeps ≤ {QUIET_SHARE:g} of the cores runnable, three runs "
          "in a row): "
          f"{'met' if _in_a_row(rows, args.runs) >= 3 else 'not met'} ({_in_a_row(rows, args.runs)} such runs in a row)")
    plot_stages([(f"{row.model}, {row.nproc} ranks", row.stages) for row in rows], args.scatter,
                f"per-stage fidelity on held-out models, default flags ({args.runs} runs)")
    print(f"per-stage scatter written to {shown(args.scatter)}")


def replay(rows: list[ZooRow], args: argparse.Namespace, work: Path) -> list[ZooRow]:
    """Every row's plan run once more, in the set's order, after all its runs; then how far the same plan's
    run moved, and how far the same model's predictions did from run to run (the two add up in a row)."""
    replayed = []
    for row in rows:
        folder = work / f"run{row.run}" / f"{row.model}-{row.nproc}"
        deeppool("run", "plan.json", "--steps", str(args.steps), "--out", "replay", cwd=folder, home=work / "home")
        summary = json.loads((folder / "replay" / "summary.json").read_text())
        replayed.append(replace(row, replayed_ms=summary["iteration_measured_ms"]))
        print(replayed[-1].replay_line(), flush=True)
    print(drift_summary(replayed), flush=True)
    return replayed


def drift_summary(rows: list[ZooRow]) -> str:
    """The same plan's two runs, and the same model's plans (same ranks and counts) across runs: how far apart."""
    moved = [abs(row.drift - 1) for row in rows if row.drift is not None]
    groups: dict[tuple[str, int, tuple[int, ...]], list[ZooRow]] = {}
    for row in rows:
        groups.setdefault((row.model, row.nproc, row.counts), []).append(row)
    planned = [max(r.predicted_ms for r in group) / min(r.predicted_ms for r in group) - 1
               for group in groups.values() if len(group) > 1]
    ran = []
    for group in groups.values():
        if len(group) > 1:
            times = [t for r in group for t in (r.measured_ms, r.replayed_ms) if t is not None]
            ran.append(max(times) / min(times) - 1)
    within = sum(row.within for row in rows), sum(abs((row.replayed_ms or 0) / row.predicted_ms - 1) <= 0.15
                                                  for row in rows)

    def figures(values: list[float]) -> str:
        if not values:
            return "none"
        return (f"median {100 * statistics.median(values):.0f}%, largest {100 * max(values):.0f}%, above 15% in "
                f"{sum(v > 0.15 for v in values)} of {len(values)}")

    return (f"the same plan run twice, minutes apart (|replay/first - 1|): {figures(moved)}\n"
            f"the same model, ranks and counts planned in different runs (largest/smallest prediction - 1): "
            f"{figures(planned)}\n"
            f"their runs and replays (largest/smallest measured - 1): {figures(ran)}\n"
            f"rows within ±15%: {within[0]} of {len(rows)} at their run, {within[1]} of {len(rows)} at the replay")


def shown(path: Path) -> str:
    """``path`` relative to the repository when inside it (figures in the docs name no machine's folders)."""
    resolved = path.resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(path)


def _in_a_row(rows: list[ZooRow], runs: int) -> int:
    """The longest streak of consecutive runs in which every row was within ±15% while the machine was quiet."""
    best = streak = 0
    for run in range(1, runs + 1):
        mine = [row for row in rows if row.run == run]
        streak = streak + 1 if mine and all(row.within and row.quiet for row in mine) else 0
        best = max(best, streak)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", action="store_true", help="held-out models with the default flags (see the module)")
    parser.add_argument("--runs", type=int, default=3, help="with --zoo: runs of every row")
    parser.add_argument("--nproc", default="2,4")
    parser.add_argument("--models", default=None,
                        help=f"default: cnn,branching_cnn,transformer,mlp; with --zoo {ZOO_MODELS}")
    parser.add_argument("--replay", action="store_true",
                        help="with --zoo: run every row's plan once more after all runs, to tell how far a plan's "
                             "run moves from how far its prediction does (region 'fidelity-zoo-replay')")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--scatter", type=Path, default=None, help="default: fidelity.png (--zoo: fidelity-zoo.png)")
    parser.add_argument("--write-docs", action="store_true",
                        help="also write the report into docs/performance.md (region 'fidelity', with --zoo "
                             "'fidelity-zoo') and the scatter to docs/images/")
    args = parser.parse_args()
    if args.runs < 1 or args.batch < 1 or args.steps < 2:
        parser.error("--runs and --batch must be at least 1, --steps at least 2")
    if args.replay and not args.zoo:
        parser.error("--replay goes with --zoo")
    name = ("fidelity-zoo-replay" if args.replay else "fidelity-zoo") if args.zoo else "fidelity"
    args.scatter = REPO / "docs" / "images" / f"{name}.png" if args.write_docs else args.scatter or Path(f"{name}.png")
    stamp = Stamp.started()
    with teed_stdout() as printed:
        if args.zoo:
            zoo(args)
        else:
            args.models = args.models or "cnn,branching_cnn,transformer,mlp"
            _measure(args)
    if args.write_docs:
        write_region(REPO / "docs" / "performance.md", name, text_block(printed.getvalue())
                     + f"\n\n![per-stage fidelity](images/{name}.png)", stamp)


def _measure(args: argparse.Namespace) -> None:
    work = Path(tempfile.mkdtemp(prefix="deeppool-fidelity-"))
    print(f"machine: {os.cpu_count()} CPU cores, load {os.getloadavg()[0]:.2f}; global batch {args.batch}, "
          f"{args.steps} steps ({args.warmup} warm-up); work in {work}")
    results = []
    for nproc in (int(n) for n in args.nproc.split(",")):
        for model in args.models.split(","):
            result = one(model, nproc, args, work)
            results.append(result)
            print(f"{model:<14} {nproc} ranks  counts {list(result.counts)!s:<10} {result.how:<28} "
                  f"predicted {result.predicted_ms:9.2f} ms  measured {result.measured_ms:9.2f} ms  "
                  f"measured/predicted {result.ratio:.2f}", flush=True)
            (compute_p, compute_m), (rest_p, rest_m) = result.compute, result.rest
            print(f"{'':<14} stages' forward+backward {compute_p:8.2f} / {compute_m:8.2f} ms; "
                  f"the rest {rest_p:8.2f} / {rest_m:8.2f} ms (predicted / measured); load {os.getloadavg()[0]:.2f}; "
                  f"{nproc} processes computing at once ran {result.contention:.2f}x slower than one just before",
                  flush=True)
            print(f"{'':<14} rank 0 by term (predicted / measured ms): "
                  + ", ".join(f"{term} {p:.2f} / {m:.2f}" for term, (p, m) in result.terms.items()), flush=True)
    ratios = [r.ratio for r in results]
    within = sum(abs(r - 1) <= 0.15 for r in ratios)
    print(f"median measured/predicted {statistics.median(ratios):.2f}; {within} of {len(ratios)} within ±15%; "
          f"load at the end {os.getloadavg()[0]:.2f}")
    scatter(results, args.scatter)
    print(f"per-stage scatter written to {shown(args.scatter)}")


if __name__ == "__main__":
    main()
