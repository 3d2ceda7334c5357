"""Executor benchmark: (a) data-parallel plans vs torch DDP, (b) a burst plan vs its prediction.

    python benchmarks/executor.py [--nproc 2] [--steps 30] [--models mlp,cnn,gpt2] [--repeats 2]
                                  [--skip-burst] [--network-file net.json]

(a) runs each model (``mlp``: this file's 7-layer MLP, batch 64; ``cnn``:
``benchmarks/models/resnet18.py``, a ResNet-18-style CNN, batch 16; ``gpt2``:
``examples/gpt2.py``, batch 4) with the same ranks, global batch and optimizer
(SGD) as a data-parallel Plan through the executor (``train_rank`` over
``TorchComm``, what ``deeppool run``'s worker runs) and as
``DistributedDataParallel``, both started by torchrun's agent and timed the
same way (wall and process CPU time per step, marked as each step fetches
its batch), interleaved ``--repeats`` times in one invocation; it prints
p25 and median wall time per step (slowest rank), their ratio (target:
executor / DDP <= 1.10) and the ratio of CPU time per step, which the other
load on a shared machine disturbs less. A model with BatchNorm gets two
rows, like for like: ``sync``, the executor's synchronised BatchNorm
(``--batchnorm sync``, global-batch statistics) against DDP with the same
``GroupBatchNorm`` on a process group of its own (torch's ``SyncBatchNorm``
refuses CPU tensors); ``local``, ``--batchnorm local`` against DDP with plain
``nn.BatchNorm`` (each rank's own statistics). (b) measures the network here
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
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from deeppool.docregions import Stamp, teed_stdout, text_block, write_region
from deeppool.model.loading import load_model

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


# -- (a) both sides, launched and timed the same way --------------------------------------------
class StepClock:
    """Wall and CPU time of each step, read as a step fetches its batch (CPU: the whole process, gloo's
    threads included; less sensitive than wall time to the other load on a shared machine)."""

    def __init__(self) -> None:
        self.marks: list[tuple[float, float]] = []

    def mark(self) -> None:
        self.marks.append((time.perf_counter(), time.process_time()))

    def steps(self, warmup: int) -> dict[str, list[float]]:
        """ms per step after ``warmup`` (each step ends where the next one fetches; the last marks the end)."""
        pairs = list(zip(self.marks, self.marks[1:]))[warmup:]
        return {"wall": [1e3 * (b[0] - a[0]) for a, b in pairs], "cpu": [1e3 * (b[1] - a[1]) for a, b in pairs]}


BACKEND = "DEEPPOOL_BENCH_BACKEND"
"""The ranks' collective backend (``--backend``), passed to them in their environment."""


def rank_device() -> tuple[str, torch.device]:
    """(backend, device) of this rank: gloo on CPU, or the GPU backend on GPU ``LOCAL_RANK`` (``--backend nccl``,
    through the device seam; never run on a GPU yet, ``benchmarks/gpu.py``)."""
    from deeppool.device.cuda import CudaGpu, backend_is_gpu

    backend = os.environ.get(BACKEND, "gloo")
    if not backend_is_gpu(backend):
        return backend, torch.device("cpu")
    return backend, CudaGpu().bind(int(os.environ.get("LOCAL_RANK", 0)))


def timed_batches(loaded, batch: int, clock: StepClock, device: torch.device | None = None):  # noqa: ANN001, ANN201
    """The model's synthetic global batch (on ``device``), every step, marking the clock at each fetch."""
    x, y = loaded.inputs(batch), loaded.targets(batch)
    if device is not None and device.type != "cpu":
        x = tuple(v.to(device) for v in x)
        y = None if y is None else y.to(device)
    while True:
        clock.mark()
        yield x, y


def ddp_worker(model_file: Path, batch: int, steps: int, warmup: int, out: Path, batchnorm: str) -> None:
    """DDP on the model: plain (``local``: each rank's BatchNorm statistics) or with BatchNorm synchronised
    by the executor's :class:`GroupBatchNorm` on a group of its own (``sync``)."""
    import torch.distributed as dist

    from deeppool.plans import ModelSpec

    backend, device = rank_device()
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    loaded = load_model(ModelSpec.parse(str(model_file)))
    module = loaded.module.to(device).train()
    if batchnorm == "sync":
        synchronise_batch_norms(module, dist.new_group(list(range(world))))
    # synchronised statistics leave every rank the same buffers: no per-forward broadcast of rank 0's
    net = nn.parallel.DistributedDataParallel(module, forward_sync_buffers=batchnorm != "sync",
                                              device_ids=None if device.type == "cpu" else [device.index])
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    start, end = rank * batch // world, (rank + 1) * batch // world
    clock = StepClock()
    for x, y in timed_batches(loaded, batch, clock, device):
        if len(clock.marks) > steps:
            break
        loaded.loss(net(*(v[start:end] for v in x)), None if y is None else y[start:end]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    _write_steps(out, rank, clock.steps(warmup))
    dist.barrier()


def executor_worker(plan_path: Path, steps: int, warmup: int, out: Path, batchnorm: str) -> None:
    """The executor's rank through its Python API (``train_rank`` over ``TorchComm``, as ``deeppool run``'s
    worker calls it), on the same synthetic batch every step."""
    import torch.distributed as dist

    from deeppool.executor.api import train_rank
    from deeppool.executor.config import BatchNormMode, OptimizerConfig, RunConfig
    from deeppool.executor.engine.comm import TorchComm
    from deeppool.executor.engine.program import rank_groups
    from deeppool.plans import Plan

    backend, device = rank_device()
    dist.init_process_group(backend)
    plan = Plan.load(plan_path)
    comm = TorchComm(rank_groups(plan), timeout_s=120.0)
    config = RunConfig(steps=steps, warmup=warmup, optimizer=OptimizerConfig(lr=0.01),
                       batchnorm=BatchNormMode(batchnorm))
    clock = StepClock()
    train_rank(plan, comm=comm, config=config, data=timed_batches(load_model(plan.model), plan.global_batch, clock),
               device=device)
    clock.mark()
    _write_steps(out, comm.rank, clock.steps(warmup))
    dist.barrier()


def _write_steps(out: Path, rank: int, steps: dict[str, list[float]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"steps-rank{rank}.json").write_text(json.dumps(steps))


def synchronise_batch_norms(module: nn.Module, group: object) -> None:
    """The executor's synchronised BatchNorm in DDP (torch's ``SyncBatchNorm`` refuses CPU tensors)."""
    import torch.distributed as dist

    from deeppool.model.syncbn import GroupBatchNorm

    def reduce(tensor: torch.Tensor) -> None:
        dist.all_reduce(tensor, group=group)

    for name, child in list(module.named_modules()):
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            parent_name, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(parent_name) if parent_name else module, leaf, GroupBatchNorm(child, reduce))


def has_batch_norm(model_file: Path) -> bool:
    from deeppool.plans import ModelSpec

    module = load_model(ModelSpec.parse(str(model_file))).module
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())


class Measured(NamedTuple):
    """One side's measured steps, pooled over repeats: wall ms of the slowest rank, and CPU ms per rank."""

    wall: list[float]
    cpu: list[list[float]]


def launch_worker(nproc: int, out: Path, *args: str) -> Measured:
    """Start ``nproc`` ranks of this file with ``args`` (torchrun's agent, as ``deeppool run``) and read their steps."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0)
    elastic_launch(config, sys.executable)(__file__, *args, str(out))
    ranks = [json.loads((out / f"steps-rank{rank}.json").read_text()) for rank in range(nproc)]
    return Measured(wall=[max(column) for column in zip(*(r["wall"] for r in ranks), strict=True)],
                    cpu=[r["cpu"] for r in ranks])


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
    from deeppool.executor.engine.comm import Backend
    from deeppool.executor.config import OptimizerConfig, RunConfig
    from deeppool.executor.launch.launch import launch
    from deeppool.plans import Optimizer, Plan

    config = RunConfig(steps=steps, warmup=warmup, optimizer=OptimizerConfig(kind=Optimizer.SGD, lr=0.01, momentum=0.0),
                       backend=Backend.AUTO, timeout_s=60.0, bucket_mb=bucket_mb, check_bound=1e-5, out_dir=out)
    launch(Plan.load(plan_path), plan_path, nproc=nproc, config=config)
    return json.loads((out / "summary.json").read_text())


def data_parallel_plan(model_file: Path, nproc: int, batch: int, path: Path) -> None:
    from deeppool.plans import ModelSpec, Strategy
    from deeppool.planner.api import CostSource, PlanRequest, plan_model

    request = PlanRequest(gpus=nproc, global_batch=batch, strategy=Strategy.DATA_PARALLEL)
    source = CostSource(device_model="a100", show_progress=False)  # times do not matter for (a)
    plan_model(ModelSpec.parse(str(model_file)), request, source).plan.save(path)


def measure_network(nproc: int, path: Path) -> None:
    from deeppool.planner.profiling.netprobe import probe_network
    from deeppool.planner.profiling.netprobe_config import ProbeConfig

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
    from deeppool.plans import ModelSpec
    from deeppool.planner.api import CostSource, PlanRequest, plan_model

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))  # as each rank runs
    request = PlanRequest(gpus=nproc, global_batch=batch)
    source = CostSource(device_model="local", network_file=network_file,
                        show_progress=False)  # every per-GPU batch the plan and its baselines use is measured
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


class Row(NamedTuple):
    """A model in one BatchNorm mode, the executor's and DDP's measured steps."""

    model: str
    batch: int
    batchnorm: str
    executor: Measured
    ddp: Measured
    baseline: list[float]


def data_parallel(args: argparse.Namespace, work: Path) -> None:
    pooled: dict[tuple[str, str], dict[str, list[Measured]]] = {}
    for repeat in range(args.repeats):
        for name in args.models.split(","):
            model_file, batch = MODELS[name]
            plan = work / f"dp-{name}.json"
            if repeat == 0:
                data_parallel_plan(model_file, args.nproc, batch, plan)
            for batchnorm in ("sync", "local") if has_batch_norm(model_file) else ("sync",):
                runs = pooled.setdefault((name, batchnorm), {"executor": [], "ddp": [], "baseline": []})
                out = work / f"dp-{name}-{batchnorm}-{repeat}"
                common = (str(args.steps), str(args.warmup))
                runs["executor"].append(launch_worker(args.nproc, out / "executor", "--executor-worker", str(plan),
                                                      *common, batchnorm))
                if args.baseline_src is not None and batchnorm == "sync":
                    run_other(args.baseline_src, plan, args.steps, args.warmup, out / "baseline")
                    runs["baseline"].append(Measured(executor_steps(out / "baseline", args.nproc, args.warmup), []))
                runs["ddp"].append(launch_worker(args.nproc, out / "ddp", "--ddp-worker", str(model_file), str(batch),
                                                 *common, batchnorm))
    rows = [Row(model=name, batch=MODELS[name][1], batchnorm=batchnorm, executor=_pool(runs["executor"]),
                ddp=_pool(runs["ddp"]), baseline=_pool(runs["baseline"]).wall)
            for (name, batchnorm), runs in pooled.items()]
    print_rows(rows, args)


def _pool(runs: list[Measured]) -> Measured:
    return Measured(wall=[t for run in runs for t in run.wall],
                    cpu=[[t for run in runs for t in run.cpu[rank]] for rank in range(len(runs[0].cpu))] if runs else [])


def print_rows(rows: list[Row], args: argparse.Namespace) -> None:
    print("\n(a) data parallel: executor vs DistributedDataParallel, same ranks, batch and SGD, launched alike;")
    print(f"    ms per step over the measured steps of {args.repeats} interleaved runs each: wall (slowest rank)")
    print("    at p25 and median, and CPU time per step (whole process, median per rank, then mean of ranks).")
    print("    BN sync: the executor's synchronised BatchNorm (global-batch statistics) on both sides, DDP's on a")
    print("    group of its own (torch's SyncBatchNorm refuses CPU tensors); BN local: nn.BatchNorm on both sides.")
    print(f"{'model':<7}{'batch':>6}{'BN':>6}{'executor p25/med':>19}{'DDP p25/med':>17}{'ratio p25/med':>15}"
          f"{'CPU exec/DDP ms':>17}{'CPU ratio':>11}")
    for row in rows:
        bn = row.batchnorm if has_batch_norm(MODELS[row.model][0]) else "-"
        cpu_exec, cpu_ddp = _cpu(row.executor), _cpu(row.ddp)
        print(f"{row.model:<7}{row.batch:>6}{bn:>6}" + _pair(row.executor.wall) + _pair(row.ddp.wall, 17)
              + _ratio(row.executor.wall, row.ddp.wall) + f"{cpu_exec:.1f} / {cpu_ddp:.1f}".rjust(17)
              + f"{cpu_exec / cpu_ddp:.3f}".rjust(11))
        if row.baseline:
            print(f"{'':<13}executor from {args.baseline_src}: {_pair(row.baseline).strip()} ms, "
                  f"its ratio to DDP p25/med {_ratio(row.baseline, row.ddp.wall).strip()}")


def _cpu(measured: Measured) -> float:
    return statistics.mean(statistics.median(rank) for rank in measured.cpu)


def run_other(source: Path, plan: Path, steps: int, warmup: int, out: Path) -> None:
    """``deeppool run`` from another source tree (e.g. a `git archive` of main), same options as :func:`run_plan`."""
    command = [sys.executable, "-m", "deeppool.run_command", "run", str(plan), "--steps", str(steps), "--warmup",
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
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="(a)'s ranks: gloo on CPU, or nccl with one GPU each (benchmarks/gpu.py)")
    parser.add_argument("--write-docs", action="store_true",
                        help="also write the report into docs/performance.md (region 'executor')")
    args = parser.parse_args()
    os.environ[BACKEND] = args.backend
    stamp = Stamp.started()
    with teed_stdout() as printed:
        _measure(args)
    if args.write_docs:
        write_region(REPO / "docs" / "performance.md", "executor", text_block(printed.getvalue()), stamp)


def _measure(args: argparse.Namespace) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    work = Path(tempfile.mkdtemp(prefix="deeppool-bench-"))
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"machine: {os.cpu_count()} CPU cores, load average {load}, torch {torch.__version__}, {args.backend}; "
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
    from deeppool.plans import Plan

    plan = Plan.load(work / "burst.json")
    measured, predicted = summary["iteration_measured_ms"], summary["iteration_predicted_ms"]
    print("\n(b) burst plan from a profile and a network measured here")
    print(f"assignment: {plan.assignment}")
    print(f"{'part':<28}{'predicted ms':>14}{'measured ms':>14}")
    for part, want, got in breakdown(summary):
        print(f"{part:<28}{want:>14.2f}{got:>14.2f}")
    print(f"measured/predicted {measured / predicted:.3f} (target within 15%)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("--ddp-worker", "--executor-worker"):
        from deeppool.model.allocator import steady_allocator

        steady_allocator()  # both sides with the allocator settings deeppool run's ranks use
    if len(sys.argv) > 1 and sys.argv[1] == "--ddp-worker":
        ddp_worker(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), Path(sys.argv[7]),
                   sys.argv[6])
    elif len(sys.argv) > 1 and sys.argv[1] == "--executor-worker":
        executor_worker(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[6]), sys.argv[5])
    else:
        main()
