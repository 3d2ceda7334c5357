"""Adasum (Maleki et al., MLSys 2021): combine gradients so that parallel ones average and orthogonal ones add.

For two gradients

    adasum(a, b) = (1 − a·b / 2|a|²) · a + (1 − a·b / 2|b|²) · b

which is symmetric: orthogonal inputs give ``a + b``, equal ones ``a``, and
``(a, −a)`` gives 0. A coefficient whose norm is below ``EPS`` is set to 1, as
Horovod does. Over ``n`` gradients the pairs are combined as a binary tree:
rank ``r`` with rank ``r + 2^k`` at level ``k`` (recursive doubling). Horovod
requires a power-of-two count; here a count that is not one is handled by
first folding the ranks above the largest power of two ``p`` into ranks
``0 … n−p−1`` (one more pairwise combine), then the tree over ``p``. That is
the same tree a single process builds (:func:`adasum`), so the distributed
result equals the single-process reference. The combination is per tensor
(per layer), as Horovod applies it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

EPS = 1e-8


def adasum_pair(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    dot = torch.dot(a.flatten().double(), b.flatten().double())
    na, nb = a.double().pow(2).sum(), b.double().pow(2).sum()
    ca = 1.0 if na < EPS else float(1 - dot / (2 * na))
    cb = 1.0 if nb < EPS else float(1 - dot / (2 * nb))
    return (ca * a.double() + cb * b.double()).to(a.dtype)


def _largest_power_of_two(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def adasum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The single-process reference: fold the extra tensors in, then the recursive-doubling tree."""
    if not tensors:
        raise ValueError("adasum of no tensors")
    values = list(tensors)
    p = _largest_power_of_two(len(values))
    for extra in range(p, len(values)):
        values[extra - p] = adasum_pair(values[extra - p], values[extra])
    values = values[:p]
    distance = 1
    while distance < p:
        for low in (i for i in range(p) if not i & distance):
            values[low] = values[low | distance] = adasum_pair(values[low], values[low | distance])
        distance *= 2
    return values[0]


Exchange = Callable[[Sequence[tuple[int, torch.Tensor]], Sequence[tuple[int, torch.Tensor]]], None]
"""Sends and receives ``(peer, tensor)`` pairs and waits for all (:meth:`deeppool.executor.engine.comm.Comm.exchange`)."""


def adasum_exchange(tensor: torch.Tensor, ranks: Sequence[int], rank: int, exchange: Exchange) -> None:
    """In place on every rank of ``ranks`` (global ranks, in order): the Adasum of their tensors.

    ``rank`` is this process's global rank. Partners swap their tensors and both compute the pair
    with the lower position's operand first, so every rank holds exactly :func:`adasum`'s result.
    """
    me, n = list(ranks).index(rank), len(ranks)
    p = _largest_power_of_two(n)
    if me >= p:  # fold: hand the tensor to the partner, receive the final result from it
        exchange([(ranks[me - p], tensor)], [])
        exchange([], [(ranks[me - p], tensor)])
        return
    if me + p < n:
        other = torch.empty_like(tensor)
        exchange([], [(ranks[me + p], other)])
        tensor.copy_(adasum_pair(tensor, other))
    distance = 1
    while distance < p:
        partner, other = ranks[me ^ distance], torch.empty_like(tensor)
        exchange([(partner, tensor)], [(partner, other)])
        low, high = (other, tensor) if me & distance else (tensor, other)
        tensor.copy_(adasum_pair(low, high))
        distance *= 2
    if me + p < n:
        exchange([(ranks[me + p], tensor)], [])


def adasum_all_reduce(tensor: torch.Tensor, ranks: Sequence[int], group: dist.ProcessGroup | None = None) -> None:
    """:func:`adasum_exchange` over an initialised ``torch.distributed`` (point-to-point, in ``group``)."""

    def exchange(sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]) -> None:
        ops = [dist.P2POp(dist.isend, t, peer, group=group) for peer, t in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, group=group) for peer, t in recvs]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    adasum_exchange(tensor, ranks, dist.get_rank(), exchange)
