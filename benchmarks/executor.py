"""Executor benchmark: (a) data-parallel plans vs torch DDP, (b) a burst plan vs its prediction.

    python benchmarks/executor.py [--nproc 2] [--steps 30] [--models mlp,cnn,gpt2] [--repeats 2]
                                  [--skip-burst] [--network-file net.json]

(a) runs each model (``mlp``: this file's 7-layer MLP, batch 64; ``cnn``:
``benchmarks/models/resnet18.py``, a ResNet-18-style CNN, batch 16; ``gpt2``:
``examples/gpt2.py``, batch 4) with the same ranks, global batch and optimizer
(SGD) as a data-parallel Plan through ``deeppool run``'s launcher and as
``DistributedDataParallel``, alternating ``--repeats`` times in one
invocation; it prints the median iteration times and their ratio (target:
executor / DDP <= 1.10). The executor's BatchNorm is synchronised over the
ranks (the global batch's statistics, as single-process training computes);
DDP's is not (each rank normalises its own samples), so on the CNN DDP does
less communication than the executor. (b) measures the network here
(``deeppool profile-network``: gloo all-reduce and point-to-point with
``--nproc`` processes, unless ``--network-file`` gives one) and a profile of
the model (one thread per rank, as the ranks run), plans it with the ILP for
``--nproc`` ranks from both, runs that plan and compares the measured
iteration time with the plan's prediction (target: within 15%), broken down
into compute and the rest (with ``--bucket-mb 0``, each layer's all-reduce
runs right after its backward and is timed on its own). A what-if line costs
the all-reduce with the all-reduce samples' own fit, since the cost model has
one bandwidth for all-reduce and point-to-point.

This file is also the benchmark's model file (``model()``, ``inputs()``,
``targets()``, ``loss()``), so every process builds the same seeded model.
"""

from __future__ import annotations

import argparse
import subprocess
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, HIDDEN, CLASSES = 512, 2048, 10


def model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(WIDTH, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
        nn.Linear(HIDDEN, WIDTH), nn.ReLU(), nn.Linear(WIDTH, CLASSES),
    )


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, WIDTH, generator=torch.Generator().manual_seed(0)),)


def targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, CLASSES, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)


REPO = Path(__file__).resolve().parents[1]
MODELS = {
    "mlp": (Path(__file__).resolve(), 64),
    "cnn": (REPO / "benchmarks" / "models" / "resnet18.py", 16),
    "gpt2": (REPO / "examples" / "gpt2.py", 4),
}
"""Benchmark model: (model file, global batch)."""


# -- (a) DDP side -------------------------------------------------------------------------------
def ddp_worker(model_file: Path, batch: int, steps: int, warmup: int, out: Path, sync_bn: bool) -> None:
    import torch.distributed as dist

    from deeppool.planner.modelspec import ModelSpec

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    loaded = ModelSpec.parse(str(model_file)).load()
    module = loaded.module.train()
    if sync_bn:
        synchronise_batch_norms(module)
    net = nn.parallel.DistributedDataParallel(module)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    start, end = rank * batch // world, (rank + 1) * batch // world
    x = {name: value[start:end] if isinstance(value, torch.Tensor) else value
         for name, value in loaded.named_inputs(batch).items()}
    y = loaded.targets(batch)
    y = None if y is None else y[start:end]
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        loaded.loss(net(**x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - began)
    per_step = torch.tensor(times[warmup:])
    dist.all_reduce(per_step, op=dist.ReduceOp.MAX)  # a step takes as long as its slowest rank
    if rank == 0:
        out.write_text(json.dumps({"step_ms": [1e3 * float(t) for t in per_step]}))
    dist.destroy_process_group()


def synchronise_batch_norms(module: nn.Module) -> None:
    """The executor's synchronised BatchNorm in DDP (torch's SyncBatchNorm needs a GPU)."""
    import torch.distributed as dist

    from deeppool.executor.syncbn import GroupBatchNorm

    def reduce(tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor)

    for name, child in list(module.named_modules()):
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            parent_name, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(parent_name) if parent_name else module, leaf, GroupBatchNorm(child, reduce))
            child.requires_grad_(True)


def has_batch_norm(model_file: Path) -> bool:
    from deeppool.planner.modelspec import ModelSpec

    module = ModelSpec.parse(str(model_file)).load().module
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


def run_ddp(
    model_file: Path, nproc: int, batch: int, steps: int, warmup: int, out: Path, sync_bn: bool = False
) -> list[float]:
    """DDP's measured steps, ms (slowest rank per step)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0)
    elastic_launch(config, sys.executable)(
        __file__, "--ddp-worker", str(model_file), str(batch), str(steps), str(warmup), str(out),
        str(int(sync_bn)))
    return [float(t) for t in json.loads(out.read_text())["step_ms"]]


def executor_steps(out: Path, nproc: int, warmup: int) -> list[float]:
    """The executor's measured steps, ms (slowest rank per step), from its per-rank traces."""
    per_rank = []
    for rank in range(nproc):
        events = json.loads((out / f"trace-rank{rank}.json").read_text())["traceEvents"]
        steps = {e["args"]["step"]: e["dur"] / 1e3 for e in events if e.get("cat") == "iteration"}
        per_rank.append([steps[step] for step in sorted(steps) if step >= warmup])
    return [max(column) for column in zip(*per_rank, strict=True)]


def quartile(values: list[float]) -> float:
    """The 25th percentile: a step's time with less of the machine's other load in it than the median."""
    return statistics.quantiles(values, n=4)[0]


# -- the executor side --------------------------------------------------------------------------
def run_plan(plan_path: Path, nproc: int, steps: int, warmup: int, out: Path, bucket_mb: float = 25.0) -> dict:
    from deeppool.executor.cli import config_args, make_config
    from deeppool.executor.comm import Backend
    from deeppool.executor.config import OptimizerKind
    from deeppool.executor.launch import launch

    config = make_config(steps=steps, warmup=warmup, optimizer=OptimizerKind.SGD, lr=0.01, momentum=0.0,
                         backend=Backend.AUTO, timeout=60.0, bucket_mb=bucket_mb, check=False, check_bound=1e-5,
                         out=out)
    launch(plan_path, nproc=nproc, config=config, worker_args=config_args(config))
    return json.loads((out / "summary.json").read_text())


def data_parallel_plan(model_file: Path, nproc: int, batch: int, path: Path) -> None:
    from deeppool.planner.api import PlanRequest, plan_model
    from deeppool.planner.api import CostSource
    from deeppool.planner.modelspec import ModelSpec
    from deeppool.planner.plan import Strategy

    request = PlanRequest(gpus=nproc, global_batch=batch, strategy=Strategy.DATA_PARALLEL)
    source = CostSource(device_model="a100", show_progress=False)  # times do not matter for (a)
    plan_model(ModelSpec.parse(str(model_file)), request, source).plan.save(path)


def measure_network(nproc: int, path: Path) -> None:
    from deeppool.executor.netprobe import ProbeConfig, probe_network

    fitted = probe_network(ProbeConfig(nproc=nproc))
    fitted.save(path)
    network = fitted.network
    print(f"\nnetwork measured with {nproc} gloo processes: point-to-point latency "
          f"{network.intra_latency_s * 1e6:.0f} us, bandwidth {network.intra_bandwidth / 1e9:.2f} GB/s; "
          f"all-reduce efficiency {network.allreduce_efficiency:.2f}, latency factor "
          f"{network.allreduce_latency_factor:.2f} (fit to the cost model's formulas)")
    for sample in fitted.samples:
        print(f"  {sample.pattern.value:<9} {sample.nbytes:>10,} B  measured {sample.seconds * 1e3:8.3f} ms  "
              f"model {fitted.predict(sample) * 1e3:8.3f} ms")


def burst_plan(nproc: int, batch: int, path: Path, network_file: Path) -> None:
    from deeppool.planner.api import CostSource, PlanRequest, plan_model
    from deeppool.planner.modelspec import ModelSpec

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))  # as each rank runs
    request = PlanRequest(gpus=nproc, global_batch=batch)
    source = CostSource(device_model="local", network_file=network_file, show_progress=False)
    plan_model(ModelSpec.parse(__file__), request, source).plan.save(path)


def breakdown(summary: dict) -> list[tuple[str, float, float]]:
    """(part, predicted ms, measured ms): compute, all-reduce (when measured per stage), the rest."""
    layers = summary["stages"]
    compute = (sum(l["fwd_predicted"] + l["bwd_predicted"] for l in layers),
               sum(l["fwd_measured"] + l["bwd_measured"] for l in layers))
    total = (summary["iteration_predicted_ms"], summary["iteration_measured_ms"])
    parts = [("compute (fwd+bwd)", *compute)]
    if all(l["allreduce_measured"] is not None for l in layers):
        reduce = (sum(l["allreduce_predicted"] for l in layers), sum(l["allreduce_measured"] for l in layers))
        parts.append(("gradient all-reduce", *reduce))
        parts.append(("reshards, optimizer, other", total[0] - compute[0] - reduce[0], total[1] - compute[1] - reduce[1]))
    else:
        parts.append(("all-reduce, reshards, optimizer", total[0] - compute[0], total[1] - compute[1]))
    return parts + [("iteration", *total)]


def data_parallel(args: argparse.Namespace, work: Path) -> None:
    rows = []
    for name in args.models.split(","):
        model_file, batch = MODELS[name]
        plan = work / f"dp-{name}.json"
        data_parallel_plan(model_file, args.nproc, batch, plan)
        synced = has_batch_norm(model_file)
        times: dict[str, list[float]] = {"executor": [], "ddp": [], "ddp_sync": [], "baseline": []}
        for repeat in range(args.repeats):
            out = work / f"dp-{name}-{repeat}"
            run_plan(plan, args.nproc, args.steps, args.warmup, out)
            times["executor"] += executor_steps(out, args.nproc, args.warmup)
            if args.baseline_src is not None:
                run_other(args.baseline_src, plan, args.steps, args.warmup, out / "baseline")
                times["baseline"] += executor_steps(out / "baseline", args.nproc, args.warmup)
            times["ddp"] += run_ddp(model_file, args.nproc, batch, args.steps, args.warmup, work / "ddp.json")
            if synced:
                times["ddp_sync"] += run_ddp(model_file, args.nproc, batch, args.steps, args.warmup,
                                             work / "ddp.json", sync_bn=True)
        rows.append((name, batch, times))
    print("\n(a) data parallel: executor vs DistributedDataParallel, ms per step (slowest rank), over all")
    print(f"    measured steps of {args.repeats} alternating runs each; p25 (25th percentile) and median.")
    print("    'DDP+sync BN': DDP with the executor's synchronised BatchNorm (the same arithmetic as the executor)")
    print(f"{'model':<7}{'batch':>6}{'executor p25/med':>19}{'DDP p25/med':>17}{'ratio p25/med':>15}"
          f"{'DDP+syncBN p25/med':>21}{'ratio p25/med':>15}")
    for name, batch, times in rows:
        line = f"{name:<7}{batch:>6}" + _pair(times["executor"]) + _pair(times["ddp"])
        line += _ratio(times["executor"], times["ddp"])
        if times["ddp_sync"]:
            line += _pair(times["ddp_sync"], 21) + _ratio(times["executor"], times["ddp_sync"])
        print(line)
        if times["baseline"]:
            print(f"{'':<13}executor from {args.baseline_src}: {_pair(times['baseline']).strip()} ms, "
                  f"its ratio to DDP p25/med {_ratio(times['baseline'], times['ddp']).strip()}")


def run_other(source: Path, plan: Path, steps: int, warmup: int, out: Path) -> None:
    """``deeppool run`` from another source tree (e.g. a `git archive` of main), same options as :func:`run_plan`."""
    command = [sys.executable, "-m", "deeppool.executor.cli", "run", str(plan), "--steps", str(steps), "--warmup",
               str(warmup), "--optimizer", "sgd", "--lr", "0.01", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(source.resolve())}
    subprocess.run(command, cwd=source, env=env, check=True, capture_output=True)


def _pair(values: list[float], width: int = 19) -> str:
    return f"{quartile(values):.1f} / {statistics.median(values):.1f}".rjust(width)


def _ratio(executor: list[float], ddp: list[float]) -> str:
    p25 = quartile(executor) / quartile(ddp)
    median = statistics.median(executor) / statistics.median(ddp)
    return f"{p25:.3f} / {median:.3f}".rjust(15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64, help="(b)'s global batch (the MLP)")
    parser.add_argument("--models", default="mlp,cnn,gpt2", help="(a)'s models: " + ", ".join(MODELS))
    parser.add_argument("--repeats", type=int, default=2, help="(a): executor and DDP runs, alternating")
    parser.add_argument("--baseline-src", type=Path, default=None,
                        help="(a): also run the executor from this source tree (e.g. `git archive main`), alternating")
    parser.add_argument("--skip-burst", action="store_true")
    parser.add_argument("--network-file", type=Path, default=None, help="plan (b) with this measured network")
    parser.add_argument("--bucket-mb", type=float, default=25.0,
                        help="(b)'s gradient buckets (0: each layer's all-reduce right after its backward)")
    parser.add_argument("--skip-dp", action="store_true", help="run only (b)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    work = Path(tempfile.mkdtemp(prefix="deeppool-bench-"))
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"machine: {os.cpu_count()} CPU cores, load average {load}, torch {torch.__version__}, gloo; "
          f"{args.nproc} ranks, {args.steps} steps ({args.warmup} warm-up)")

    if not args.skip_dp:
        data_parallel(args, work)

    if args.skip_burst:
        return
    network = args.network_file
    if network is None:
        network = work / "network.json"
        measure_network(args.nproc, network)
    burst_plan(args.nproc, args.batch, work / "burst.json", network)
    summary = run_plan(work / "burst.json", args.nproc, args.steps, args.warmup, work / "burst", bucket_mb=args.bucket_mb)
    from deeppool.planner.plan import Plan

    plan = Plan.load(work / "burst.json")
    measured, predicted = summary["iteration_measured_ms"], summary["iteration_predicted_ms"]
    print("\n(b) burst plan from a profile and a network measured here")
    print(f"assignment: {plan.assignment}")
    print(f"{'part':<28}{'predicted ms':>14}{'measured ms':>14}")
    for part, want, got in breakdown(summary):
        print(f"{part:<28}{want:>14.2f}{got:>14.2f}")
    print(f"measured/predicted {measured / predicted:.3f} (target within 15%)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--ddp-worker":
        ddp_worker(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[6]),
                   bool(int(sys.argv[7])))
    else:
        main()
