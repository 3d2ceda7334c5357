"""One rank's process: ``python -m deeppool.executor plan.json config.json`` (under torchrun).

Reads the rank and world from torchrun's environment (without it, runs a
single rank), initialises ``torch.distributed`` with collective timeouts,
trains, writes its Chrome trace, and on rank 0 prints and saves the summary.
A failure is written to ``<out>/error-rank<r>.json`` and printed as one line
naming the rank; the exit code tells its kind (:class:`Failure`).
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import json
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from deeppool.adaptation.policy import load_policy
from deeppool.device.cuda import CudaGpu
from deeppool.device.seam import Gpu
from deeppool.errors import DeeppoolError
from deeppool.executor.api import RankResult, train_rank
from deeppool.executor.config import RunConfig
from deeppool.executor.engine.comm import Backend, PeerError, TorchComm
from deeppool.executor.engine.faults import Slowdown
from deeppool.executor.engine.idle import StartLender
from deeppool.executor.engine.program import rank_groups
from deeppool.executor.engine.timing import Span, chrome_trace
from deeppool.executor.launch.report import print_summary
from deeppool.model.allocator import steady_allocator
from deeppool.output import console
from deeppool.plans import Plan
from deeppool.plans.jsonio import write_json


class Failure(enum.Enum):
    """Why a rank stopped, with its exit code."""

    CRASH = 1
    USER = 2
    CHECK = 3
    PEER = 4
    INTERRUPTED = 130


class CheckFailed(Exception):
    """``--check`` found a difference over the bound."""


@dataclass(frozen=True, kw_only=True)
class RankEnv:
    rank: int
    local_rank: int
    world_size: int

    @classmethod
    def from_environ(cls) -> RankEnv:
        return cls(
            rank=int(os.environ.get("RANK", 0)),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            world_size=int(os.environ.get("WORLD_SIZE", 1)),
        )


def run_worker(plan: Plan, config: RunConfig, env: RankEnv, lender: StartLender | None = None,
               gpu: Gpu | None = None) -> None:
    """``lender``: what starts background work in this rank's idle windows (none when not given);
    ``gpu``: the device seam (the real GPU when not given)."""
    gpu = gpu or CudaGpu()
    if env.world_size != plan.gpus:
        raise DeeppoolError(
            f"the plan is for {plan.gpus} GPUs but {env.world_size} ranks were started: start {plan.gpus}"
        )
    backend = config.backend.resolve(gpu.available())
    device = bind_device(backend, env, gpu)
    if device.type == "cpu":
        steady_allocator()  # as the profile was measured: no page faults on every iteration's activations
    _init(backend, env, config.timeout_s)
    comm = TorchComm(rank_groups(plan), timeout_s=config.timeout_s)
    mux = lender(plan, rank=env.rank, out_dir=config.out_dir, device=device) if lender is not None else None
    try:
        with mux.foreground() if mux is not None else contextlib.nullcontext():
            on_idle = mux.listener if mux is not None else None
            result = train_rank(plan, comm=comm, config=config, device=device, on_idle=on_idle,
                                policy=load_policy(config.policy) if config.policy is not None else None,
                                slowdown=Slowdown.from_environ(os.environ))
    finally:
        if mux is not None:
            mux.stop()
    sections = mux.gather(comm, result.spans) if mux is not None else {}
    _write_outputs(result, config.out_dir, mux.trace_spans() if mux else [], sections)
    dist.barrier()  # no rank tears its groups down while another still talks in them (gloo aborts on that)
    comm.close()
    dist.destroy_process_group()
    if result.summary is not None:
        shown = console()
        print_summary(result.summary, shown)
        if mux is not None:
            mux.show(shown)
        check = result.summary.check
        if check is not None and not check.passed:
            where = f" ({check.worst.describe()})" if check.worst is not None else ""
            raise CheckFailed(
                f"check failed: max relative difference {check.max_relative_difference:.3e} "
                f"exceeds the bound {check.bound:g}{where}"
            )


def bind_device(backend: Backend, env: RankEnv, gpu: Gpu) -> torch.device:
    """The rank's device: CPU for gloo; for the GPU backend, GPU ``local_rank % count``, bound."""
    if backend is not Backend.NCCL:
        return torch.device("cpu")
    if not gpu.available():
        raise DeeppoolError(f"--backend {backend.value} needs CUDA, and no GPU is visible: use --backend gloo")
    return gpu.bind(env.local_rank)


def _init(backend: Backend, env: RankEnv, timeout_s: float) -> None:
    timeout = datetime.timedelta(seconds=timeout_s)
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend.value, timeout=timeout)
        return
    with socket.socket() as probe:  # a lone rank, started without torchrun
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    dist.init_process_group(
        backend.value, init_method=f"tcp://127.0.0.1:{port}", rank=env.rank, world_size=env.world_size, timeout=timeout
    )


def _write_outputs(
    result: RankResult, out_dir: Path | None, extra: list[Span], sections: dict[str, Any]
) -> None:
    if out_dir is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / f"trace-rank{result.rank}.json", chrome_trace([*result.spans, *extra], rank=result.rank,
                                                                             counters=result.counters))
    if result.summary is not None:
        write_json(out_dir / "summary.json", {**result.summary.to_json(), **sections})


def classify(err: BaseException) -> Failure:
    if isinstance(err, KeyboardInterrupt):
        return Failure.INTERRUPTED
    if isinstance(err, CheckFailed):
        return Failure.CHECK
    if isinstance(err, DeeppoolError):
        return Failure.USER
    if isinstance(err, PeerError) or _is_comm_error(err):
        return Failure.PEER
    return Failure.CRASH


def _is_comm_error(err: BaseException) -> bool:
    return isinstance(err, getattr(dist, "DistError", ())) or "gloo" in str(err).lower()


def report_failure(err: BaseException, env: RankEnv, out_dir: Path | None) -> Failure:
    """Print one line naming this rank (and a traceback for a crash) and record it."""
    kind = classify(err)
    message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if kind is Failure.CRASH:
        traceback.print_exception(err, file=sys.stderr)
        message = f"{type(err).__name__}: {message}"
    print(f"deeppool: rank {env.rank}: {message}", file=sys.stderr, flush=True)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        record = {"rank": env.rank, "kind": kind.name.lower(), "message": message, "time": time.time()}
        (out_dir / f"error-rank{env.rank}.json").write_text(json.dumps(record) + "\n")
    return kind
