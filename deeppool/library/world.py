"""Joining the ranks of a user's script: ``torch.distributed`` from torchrun's environment.

A script started by ``torchrun`` (or ``deeppool run --script``) finds ``MASTER_ADDR``, ``RANK`` and
``WORLD_SIZE`` in its environment; :func:`join` initialises the default process group from them (NCCL
when a GPU is visible, gloo otherwise), unless the script already did. Started as a plain ``python``
process, the script is one rank of a world of one. :func:`broadcast_module` then gives every rank rank
0's parameters and buffers, as ``DistributedDataParallel`` does at construction, so a model built without
a seed is still one model.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from deeppool.device.cuda import CudaGpu, backend_is_gpu
from deeppool.errors import DeeppoolError
from deeppool.model.allocator import steady_allocator


def join(gpus: int, timeout_s: float) -> torch.device:
    """Initialise the default group (if the script did not) and return this rank's device.

    Refuses a world whose size is not the plan's GPU count. On CPU the allocator keeps freed memory, as
    ``deeppool run``'s ranks do (:func:`~deeppool.model.allocator.steady_allocator`).
    """
    gpu = CudaGpu()
    if not dist.is_initialized():
        backend = gpu.backend if gpu.available() else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
                                    timeout=timeout)
    world = dist.get_world_size()
    if world != gpus:
        raise DeeppoolError(f"the plan is for {gpus} GPUs but {world} ranks were started: "
                            f"start {gpus} (torchrun --nproc-per-node {gpus}, or deeppool run --script)")
    if not backend_is_gpu(dist.get_backend()):
        steady_allocator()
        return torch.device("cpu")
    return gpu.bind(int(os.environ.get("LOCAL_RANK", 0)))


def broadcast_module(module: nn.Module) -> None:
    """Every rank's parameters and buffers become rank 0's (one broadcast per dtype)."""
    if dist.get_world_size() == 1:
        return
    unique = {id(t): t for t in (*module.parameters(), *module.buffers())}
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for tensor in unique.values():
        by_dtype[tensor.dtype].append(tensor)
    device = CudaGpu().current() if backend_is_gpu(dist.get_backend()) else torch.device("cpu")
    with torch.no_grad():
        for dtype in sorted(by_dtype, key=str):
            tensors = by_dtype[dtype]
            flat = torch.cat([t.detach().reshape(-1).to(device) for t in tensors])
            dist.broadcast(flat, src=0)
            for tensor, piece in zip(tensors, flat.split([t.numel() for t in tensors]), strict=True):
                tensor.copy_(piece.view_as(tensor))


def world_sum(values: list[float], device: torch.device) -> list[float]:
    """The sum of ``values`` over every rank (one all-reduce)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor.tolist()


def world_sum_lazy(value: float, device: torch.device) -> torch.Tensor:
    """The sum of ``value`` over every rank as a 0-dim float32 tensor whose all-reduce runs in the
    background: it is waited for when the tensor is first read (``loss.item()``, printing, arithmetic),
    so a loop that reads the loss only now and then never waits for the other ranks on it, as
    ``deeppool run``'s ranks do not (torch's functional collectives: an ``AsyncCollectiveTensor``). The
    tensor is reduced as it is: indexing a one-element result would dispatch through the subclass again."""
    tensor = torch.tensor(value, dtype=torch.float32, device=device)
    if dist.get_world_size() == 1:
        return tensor
    return funcol.all_reduce(tensor, "sum", dist.group.WORLD)


class LazyTotals:
    """A loop's :func:`world_sum_lazy` totals, each waited for once the next is asked for (finished long since)
    and the last at exit: collectives never waited for pile up in torch's registry, which warns of each at exit."""

    def __init__(self) -> None:
        self.last: torch.Tensor | None = None

    def total(self, value: float, device: torch.device) -> torch.Tensor:
        self.settle()
        self.last = world_sum_lazy(value, device)
        return self.last

    def settle(self) -> None:
        if isinstance(self.last, funcol.AsyncCollectiveTensor) and dist.is_initialized():
            self.last.trigger_wait()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
