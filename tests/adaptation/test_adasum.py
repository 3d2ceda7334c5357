"""Adasum: the pairwise rule's three cases, and the distributed tree equal to the single-process one on gloo."""

from __future__ import annotations

import datetime
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deeppool.adaptation.adasum import adasum, adasum_all_reduce, adasum_pair

WORLD, SIZES = 8, (2, 3, 4, 5, 8)


def test_orthogonal_inputs_add_parallel_ones_average_opposite_ones_cancel() -> None:
    a, b = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 2.0, 0.0])
    assert torch.allclose(adasum_pair(a, b), a + b)
    assert torch.allclose(adasum_pair(a, 3 * a), 2 * a)  # their mean
    assert torch.allclose(adasum_pair(a, -a), torch.zeros(3))
    assert torch.allclose(adasum_pair(torch.zeros(3), b), b)  # a zero norm leaves the other as it is
    assert torch.allclose(adasum([a, a, a, a]), a)
    assert torch.allclose(adasum([a, b]), adasum_pair(b, a))  # symmetric


def tensor_of(rank: int) -> torch.Tensor:
    return torch.randn(257, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)


def _rank(rank: int, port: int, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    for size in SIZES:
        if rank < size:
            mine = tensor_of(rank)
            adasum_all_reduce(mine, list(range(size)))
            results.put((size, rank, mine.tolist()))  # a list: a shared tensor dies with its process
        dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
def test_gloo_ranks_match_the_single_process_reference() -> None:
    context = mp.get_context("spawn")
    results = context.Queue()
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    processes = mp.start_processes(_rank, args=(port, results), nprocs=WORLD, join=False, start_method="spawn")
    got: dict[tuple[int, int], torch.Tensor] = {}
    for _ in range(sum(SIZES)):  # read while they run: a full pipe would block their puts
        size, rank, tensor = results.get(timeout=300)
        got[(size, rank)] = torch.tensor(tensor, dtype=torch.float64)
    while not processes.join():
        pass
    for size in SIZES:
        reference = adasum([tensor_of(r) for r in range(size)])
        for rank in range(size):
            assert torch.equal(got[(size, rank)], reference), (size, rank)  # bit for bit, on every rank
