"""An in-process stand-in for torch.distributed: ranks are threads of one process."""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from typing import Any

import torch

from deeppool.executor.api import ModelBuilder
from deeppool.executor.engine.comm import Done, Lane, PeerError
from deeppool.model.loading import LoadedModel, load_model
from deeppool.model.trace import Traced, trace
from deeppool.plans import ModelSpec

TIMEOUT_S = 60.0


class ThreadWorld:
    """Shared mailboxes and collective rendezvous for ``size`` thread ranks."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.mail: dict[tuple[int, int], deque[torch.Tensor]] = defaultdict(deque)
        self.slots: dict[tuple[Any, int], dict[int, Any]] = defaultdict(dict)
        self.taken: dict[tuple[Any, int], int] = defaultdict(int)
        self.failed: str | None = None

    def comms(self) -> list[ThreadComm]:
        return [ThreadComm(self, rank) for rank in range(self.size)]

    def wait_for(self, predicate: Callable[[], bool], what: str) -> None:
        if not self.cond.wait_for(lambda: predicate() or self.failed is not None, timeout=TIMEOUT_S):
            raise PeerError(f"timed out: {what}")
        if self.failed is not None and not predicate():
            raise PeerError(f"{what}: {self.failed}")


class ThreadComm:
    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world = world
        self.rank = rank
        self.world_size = world.size
        self._seq: dict[Any, int] = defaultdict(int)

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]) -> None:
        w = self.world
        with w.cond:
            for peer, tensor in sends:
                w.mail[(self.rank, peer)].append(tensor.detach().clone())
            w.cond.notify_all()
            for peer, tensor in recvs:
                box = w.mail[(peer, self.rank)]
                w.wait_for(lambda box=box: bool(box), f"rank {self.rank} recv from {peer}")
                sent = box.popleft()
                if (sent.dtype, sent.shape) != (tensor.dtype, tensor.shape):  # gloo would fail or garble
                    raise PeerError(f"rank {self.rank} received {sent.dtype}{list(sent.shape)} from {peer} "
                                    f"into {tensor.dtype}{list(tensor.shape)}")
                tensor.copy_(sent)

    def _collective(self, key: Any, ranks: tuple[int, ...], value: Any, combine: Callable[[list[Any]], Any]) -> Any:
        w = self.world
        seq = self._seq[key]
        self._seq[key] += 1
        slot = (key, seq)
        with w.cond:
            w.slots[slot][self.rank] = value
            w.cond.notify_all()
            w.wait_for(lambda: len(w.slots[slot]) == len(ranks), f"rank {self.rank} collective {key}")
            result = combine([w.slots[slot][r] for r in ranks])
            w.taken[slot] += 1
            if w.taken[slot] == len(ranks):
                del w.slots[slot], w.taken[slot]
        return result

    def all_reduce(
        self, tensor: torch.Tensor, ranks: tuple[int, ...], *, async_op: bool = False, lane: Lane = Lane.GRADIENTS,
    ) -> Done:
        summed = self._collective((ranks, lane), ranks, tensor.detach().clone(), _sum)
        tensor.copy_(summed)
        return Done()

    def all_reduce_max(self, value: float) -> float:
        return self._collective("max", tuple(range(self.world_size)), value, max)

    def gather(self, obj: Any) -> list[Any] | None:
        everyone = self._collective("gather", tuple(range(self.world_size)), obj, list)
        return everyone if self.rank == 0 else None

    def all_gather(self, values: Sequence[float]) -> list[tuple[float, ...]]:
        return self._collective("all_gather", tuple(range(self.world_size)), tuple(float(v) for v in values), list)


def _sum(values: list[torch.Tensor]) -> torch.Tensor:
    total = values[0].clone()
    for value in values[1:]:
        total += value
    return total


class SerialBuilder(ModelBuilder):
    """Builds and traces one model at a time (the RNG and fx's patching are process-global).

    fx patches ``nn.Module.__call__`` while it traces, so no thread may run a
    model then: every rank waits until all ranks have traced.
    """

    def __init__(self, ranks: int) -> None:
        self._lock = threading.Lock()
        self._traced = threading.Barrier(ranks, timeout=TIMEOUT_S)

    def load(self, spec: ModelSpec) -> LoadedModel:
        with self._lock:
            return load_model(spec)

    def trace(self, loaded: LoadedModel) -> Traced:
        with self._lock:
            traced = trace(loaded)
        self._traced.wait()
        return traced


def run_threads(world: ThreadWorld, target: Callable[[ThreadComm], Any]) -> list[Any]:
    """Run ``target(comm)`` on one thread per rank; re-raise the first failure."""
    results: list[Any] = [None] * world.size
    errors: list[BaseException | None] = [None] * world.size

    def body(comm: ThreadComm) -> None:
        try:
            results[comm.rank] = target(comm)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors[comm.rank] = err
            with world.cond:
                world.failed = f"rank {comm.rank} failed: {err}"
                world.cond.notify_all()

    threads = [threading.Thread(target=body, args=(comm,)) for comm in world.comms()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    first = next((e for e in errors if e is not None and not isinstance(e, PeerError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
