"""Ranks as real processes over gloo: :func:`train_rank` (the Python API) with a :class:`TorchComm`.

Each job is trained by every rank in turn, in one set of processes (starting
them costs more than a tiny model's training). Results come back without
tensors: a tensor sent through a queue dies with its process.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import queue as queue_module
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deeppool.device.fake import FakeGpu
from deeppool.executor.api import train_rank
from deeppool.executor.config import RunConfig
from deeppool.executor.engine.comm import TorchComm
from deeppool.executor.engine.monitor import GnsReading
from deeppool.executor.engine.program import rank_groups
from deeppool.executor.engine.timing import Counter
from deeppool.plans import Plan
from tests.net import free_port

TIMEOUT_S = 300.0

Data = Callable[[], list[Any]]
"""Builds a job's global batches in the rank's process (a picklable function)."""


@dataclass(frozen=True, kw_only=True)
class Job:
    plan: Plan
    config: RunConfig
    data: Data | None = None
    fake_gpu: bool = False
    """Run the rank through the fake GPU (:class:`~deeppool.device.fake.FakeGpu`): side-stream all-reduce,
    device events and synchronisation as on a GPU, each wait checked."""


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """What one rank returned from one job."""

    rank: int
    losses: tuple[float, ...]
    params: dict[str, np.ndarray]
    gns: tuple[GnsReading, ...]
    counters: tuple[Counter, ...]
    summary: dict[str, Any] | None = field(default=None)
    device_work: dict[str, int] = field(default_factory=dict)
    """With ``fake_gpu``: how many items of work the fake ran, by label (``replay``, ``collective``, ops)."""

    def counted(self, name: str) -> list[Counter]:
        return [c for c in self.counters if c.name == name]


def train_gloo(jobs: list[Job]) -> list[list[Outcome]]:
    """Every job's outcome per rank (all jobs' plans are for the same number of GPUs)."""
    world = jobs[0].plan.gpus
    assert all(job.plan.gpus == world for job in jobs)
    context = mp.get_context("spawn")
    queue = context.Queue()
    processes = mp.start_processes(_rank, args=(world, free_port(), jobs, queue), nprocs=world, join=False,
                                   start_method="spawn")
    got: dict[tuple[int, int], Outcome] = {}
    deadline = time.monotonic() + TIMEOUT_S
    while len(got) < world * len(jobs):  # read while they run: a full pipe would block their puts
        if time.monotonic() > deadline:
            raise TimeoutError(f"{world} gloo ranks returned {len(got)} of {world * len(jobs)} results in {TIMEOUT_S} s")
        try:
            item = queue.get(timeout=1.0)
        except queue_module.Empty:
            processes.join(timeout=0)  # raises when a rank died
            continue
        if isinstance(item, str):
            raise RuntimeError(item)
        index, outcome = item
        got[(index, outcome.rank)] = outcome
    while not processes.join():
        pass
    return [[got[(index, rank)] for rank in range(world)] for index in range(len(jobs))]


def _rank(rank: int, world: int, port: int, jobs: list[Job], queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        for index, job in enumerate(jobs):
            comm = TorchComm(rank_groups(job.plan), timeout_s=TIMEOUT_S)
            gpu = FakeGpu() if job.fake_gpu else None
            with gpu.on(torch.device("cpu")) if gpu is not None else contextlib.nullcontext():
                result = train_rank(job.plan, comm=comm, config=job.config, data=job.data() if job.data else None,
                                    gpu=gpu)
            queue.put((index, Outcome(
                rank=rank, losses=result.losses, gns=result.gns, counters=result.counters,
                params={name: p.numpy().copy() for name, p in result.params.items()},
                summary=None if result.summary is None else result.summary.to_json(),
                device_work=dict(collections.Counter(item.label for item in gpu.log)) if gpu is not None else {},
            )))
        dist.barrier()
    except BaseException:  # noqa: BLE001 - the parent raises it
        queue.put(f"rank {rank}: {traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()
