"""Executor benchmark: (a) a data-parallel plan vs torch DDP, (b) a burst plan vs its prediction.

    python benchmarks/executor.py [--nproc 2] [--steps 30] [--batch 64] [--skip-burst] [--network-file net.json]

(a) runs the same model, ranks, global batch and optimizer (SGD) twice in one
invocation: once as a data-parallel Plan through ``deeppool run``'s launcher,
once as ``DistributedDataParallel``; it prints the median iteration times and
their ratio (target: executor / DDP <= 1.10). (b) measures the network here
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
import json
import math
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


# -- (a) DDP side -------------------------------------------------------------------------------
def ddp_worker(batch: int, steps: int, warmup: int, out: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = nn.parallel.DistributedDataParallel(model())
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    start, end = rank * batch // world, (rank + 1) * batch // world
    x, y = inputs(batch)[0][start:end], targets(batch)[start:end]
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        loss(net(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - began)
    slowest = torch.tensor([statistics.median(times[warmup:])])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        out.write_text(json.dumps({"iteration_ms": 1e3 * float(slowest)}))
    dist.destroy_process_group()


def run_ddp(nproc: int, batch: int, steps: int, warmup: int, out: Path) -> float:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0)
    elastic_launch(config, sys.executable)(__file__, "--ddp-worker", str(batch), str(steps), str(warmup), str(out))
    return float(json.loads(out.read_text())["iteration_ms"])


# -- the executor side --------------------------------------------------------------------------
def run_plan(plan_path: Path, nproc: int, steps: int, warmup: int, out: Path, bucket_mb: float = 25.0) -> dict:
    from deeppool.executor.cli import config_args, make_config
    from deeppool.executor.comm import Backend
    from deeppool.executor.config import OptimizerKind
    from deeppool.executor.launch import launch

    config = make_config(steps=steps, warmup=warmup, optimizer=OptimizerKind.SGD, lr=0.01, momentum=0.0,
                         backend=Backend.AUTO, timeout=300.0, bucket_mb=bucket_mb, check=False, check_bound=1e-5,
                         out=out)
    launch(plan_path, nproc=nproc, config=config, worker_args=config_args(config))
    return json.loads((out / "summary.json").read_text())


def data_parallel_plan(nproc: int, batch: int, path: Path) -> None:
    from deeppool.planner.api import PlanRequest, plan_model
    from deeppool.planner.api import CostSource
    from deeppool.planner.modelspec import ModelSpec
    from deeppool.planner.plan import Strategy

    request = PlanRequest(gpus=nproc, global_batch=batch, strategy=Strategy.DATA_PARALLEL)
    source = CostSource(device_model="a100", show_progress=False)  # times do not matter for (a)
    plan_model(ModelSpec.parse(__file__), request, source).plan.save(path)


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
    data_parallel_plan(args.nproc, args.batch, work / "dp.json")
    executor = run_plan(work / "dp.json", args.nproc, args.steps, args.warmup, work / "dp")["iteration_measured_ms"]
    ddp = run_ddp(args.nproc, args.batch, args.steps, args.warmup, work / "ddp.json")
    print("\n(a) data parallel: executor vs DistributedDataParallel")
    print(f"{'run':<28}{'ms/iteration':>14}")
    print(f"{'deeppool executor (DP plan)':<28}{executor:>14.2f}")
    print(f"{'torch DDP':<28}{ddp:>14.2f}")
    print(f"ratio executor/DDP: {executor / ddp:.3f} (target <= 1.10)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--skip-burst", action="store_true")
    parser.add_argument("--network-file", type=Path, default=None, help="plan (b) with this measured network")
    parser.add_argument("--bucket-mb", type=float, default=25.0,
                        help="(b)'s gradient buckets (0: each layer's all-reduce right after its backward)")
    parser.add_argument("--skip-dp", action="store_true", help="run only (b)")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    work = Path(tempfile.mkdtemp(prefix="deeppool-bench-"))
    print(f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, gloo; "
          f"{args.nproc} ranks, global batch {args.batch}, {args.steps} steps ({args.warmup} warm-up)")

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
        ddp_worker(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]))
    else:
        main()
