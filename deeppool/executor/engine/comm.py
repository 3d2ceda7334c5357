"""Communication, injected: the executor talks to its peers only through :class:`Comm`.

:class:`TorchComm` is the real one over ``torch.distributed`` (gloo on CPU,
NCCL on GPU): point-to-point moves go through ``batch_isend_irecv``, and one
process group is created per distinct rank set and :class:`Lane`, all up front
and in the same order on every rank (``new_group`` is collective). Tests
substitute an in-process fake with the same protocol.
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from deeppool.device.cuda import CudaGpu, backend_is_gpu
from deeppool.executor.config import Backend

__all__ = ["Backend", "Comm", "Done", "Lane", "PeerError", "TorchComm", "Waitable"]


class Lane(enum.Enum):
    """Which of a rank set's process groups a collective goes through.

    A process group runs its collectives in the order they were issued, so a small blocking
    all-reduce issued while a large gradient bucket is in flight on the same group waits for the
    bucket. Synchronised BatchNorm's statistics take a lane of their own.
    """

    GRADIENTS = "gradients"
    """Bucketed gradient all-reduces (asynchronous, up to a bucket each)."""
    STATISTICS = "statistics"
    """Synchronised BatchNorm's small blocking all-reduces."""


class Waitable(Protocol):
    def wait(self) -> Any: ...


class Done:
    """A handle for work that has already finished."""

    def wait(self) -> bool:
        return True


class PeerError(RuntimeError):
    """A communication with other ranks failed (a peer died, timed out or raised)."""


class Comm(Protocol):
    """What the executor needs from its peers; ranks are global ranks."""

    rank: int
    world_size: int

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Send and receive these tensors (in this order per peer) and wait for all."""
        ...

    def all_reduce(
        self, tensor: torch.Tensor, ranks: tuple[int, ...], *, async_op: bool = False, lane: Lane = Lane.GRADIENTS,
    ) -> Waitable:
        """Sum ``tensor`` in place over ``ranks`` (a group made at construction) on ``lane``."""
        ...

    def all_reduce_max(self, value: float) -> float:
        """The maximum of ``value`` over all ranks."""
        ...

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (in rank order), None elsewhere."""
        ...

    def all_gather(self, values: Sequence[float]) -> list[tuple[float, ...]]:
        """Every rank's ``values`` (the same length on every rank) on every rank, in rank order."""
        ...


class TorchComm:
    """:class:`Comm` over an initialised ``torch.distributed`` default group: a process group per rank set
    in ``groups`` and lane in ``lanes``."""

    def __init__(
        self, groups: Sequence[tuple[int, ...]], *, timeout_s: float, lanes: tuple[Lane, ...] = tuple(Lane),
    ) -> None:
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        timeout = datetime.timedelta(seconds=timeout_s)
        self._groups: dict[tuple[tuple[int, ...], Lane], Any] = {}
        for ranks in sorted(set(groups), key=lambda r: (len(r), r)):
            for lane in lanes:
                self._groups[(ranks, lane)] = dist.new_group(list(ranks), timeout=timeout)

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]) -> None:
        ops = [dist.P2POp(dist.isend, tensor, peer) for peer, tensor in sends]
        ops += [dist.P2POp(dist.irecv, tensor, peer) for peer, tensor in recvs]
        if not ops:
            return
        peers = sorted({peer for peer, _ in (*sends, *recvs)})
        try:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        except Exception as err:
            raise PeerError(f"exchange with ranks {peers} failed: {_first_line(err)}") from err

    def all_reduce(
        self, tensor: torch.Tensor, ranks: tuple[int, ...], *, async_op: bool = False, lane: Lane = Lane.GRADIENTS,
    ) -> Waitable:
        group = self._groups[(ranks, lane)]
        try:
            work = dist.all_reduce(tensor, group=group, async_op=async_op)
        except Exception as err:
            raise PeerError(f"all-reduce over ranks {list(ranks)} failed: {_first_line(err)}") from err
        return _Checked(work, self.rank, ranks) if async_op else Done()

    def all_reduce_max(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64, device=_device())
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        except Exception as err:
            raise PeerError(f"all-reduce over all ranks failed: {_first_line(err)}") from err
        return float(tensor.item())

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        try:
            dist.gather_object(obj, out, dst=0)
        except Exception as err:
            raise PeerError(f"gathering results on rank 0 failed: {_first_line(err)}") from err
        return out

    def close(self) -> None:
        """Tear the groups down in the order they were made, then wait for every rank to have done so.

        Left to ``destroy_process_group()`` the ranks close their groups at different moments, and a
        rank still holding a group whose peer has already closed it can be aborted by gloo; after this
        only the default group is torn down unsynchronised."""
        for group in self._groups.values():
            dist.destroy_process_group(group)
        self._groups.clear()
        dist.barrier()

    def all_gather(self, values: Sequence[float]) -> list[tuple[float, ...]]:
        mine = torch.tensor(list(values), dtype=torch.float64, device=_device())
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        try:
            dist.all_gather(rows, mine)
        except Exception as err:
            raise PeerError(f"all-gather over all ranks failed: {_first_line(err)}") from err
        return [tuple(row.tolist()) for row in rows]


class _Checked:
    """An async handle whose failure names the rank and group."""

    def __init__(self, work: Any, rank: int, ranks: tuple[int, ...]) -> None:
        self._work, self._rank, self._ranks = work, rank, ranks

    def wait(self) -> bool:
        try:
            self._work.wait()
        except Exception as err:
            raise PeerError(
                f"all-reduce over ranks {list(self._ranks)} failed: {_first_line(err)}"
            ) from err
        return True


def _device() -> torch.device:
    """Where this rank's collectives take their tensors: the bound GPU for the GPU backend, else CPU."""
    return CudaGpu().current() if backend_is_gpu(dist.get_backend()) else torch.device("cpu")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:300] if text else type(err).__name__
