"""Gradient all-reduce inside each layer's rank group, bucketed.

Each rank group has its own bucket: a layer's gradients join its group's
bucket, and a bucket of about ``bucket_bytes`` is summed with one asynchronous
all-reduce, overlapping the rest of the backward (as DDP does);
:meth:`GradientReducer.finish` flushes the rest and waits before the optimizer
step. A group's buckets fill and flush only at that group's layers, which all
its ranks run in the same order, so every member issues the group's
collectives (these and synchronised BatchNorm's) in one order. Gradients
are handed over while the backward runs (:mod:`deeppool.executor.engine.overlap`).
On a GPU, as in DDP, a group's first bucket of an iteration is capped at
1 MiB (``first_bucket_bytes``), so the first all-reduce starts early; on CPU
the ranks share the cores with gloo's threads, an early small all-reduce
only competes with the backward, and it is not capped. On a GPU the reducer is
given a side stream: a bucket is flattened and its all-reduce launched on
it (after the compute stream's work so far), so neither the copy nor the
collective queues behind the rest of the backward; :meth:`finish` makes the
compute stream wait for it. On CPU (gloo) there is no stream. The streams, and
the collective's place among them, go through the device seam
(:mod:`deeppool.device`), whose fake runs this on CPU and checks every wait. With
``bucket_bytes == 0`` each layer's gradients are reduced synchronously right
after its backward, so measured all-reduce times line up with the plan's.

With a :class:`~deeppool.executor.engine.monitor.NormMeter` (``--monitor gns``), each
bucket's squared norm is taken before its all-reduce is launched and after it
has been waited for. With :attr:`Combine.ADASUM <deeppool.plans.enums.Combine>`
the layer's gradients are not bucketed: :meth:`GradientReducer.add` combines
them at once, one layer per call (Adasum is defined per layer, so no call
mixes layers): each rank's pre-scaled gradient ``(n_r/B)·ḡ_r`` is multiplied
by ``B/n_r`` (its ``scales`` entry), the ranks' own mean gradients ``ḡ_r``
over the layer's parameters, flattened together, are combined by
:func:`~deeppool.adaptation.adasum.adasum_exchange` (point-to-point in the
group; a group that is not a power of two folds its extra ranks in first), and
every rank gets the result. Gradients of parallel ranks average, orthogonal
ones add.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from deeppool.adaptation.adasum import adasum_exchange
from deeppool.device.seam import Gpu, Stream
from deeppool.executor.engine.comm import Comm, Waitable
from deeppool.executor.engine.monitor import NormMeter
from deeppool.plans import Combine

FIRST_BUCKET_BYTES = 2**20
"""DDP's ``first_bucket_bytes``: the first bucket of an iteration is small, so its all-reduce starts early."""


class GradientReducer:
    def __init__(
        self, comm: Comm, bucket_bytes: int, side: tuple[Gpu, Stream] | None = None,
        first_bucket_bytes: int | None = None, meter: NormMeter | None = None, combine: Combine = Combine.SUM,
        scales: dict[tuple[int, ...], float] | None = None,
    ) -> None:
        """``side``: the device and the side stream the buckets are flattened and reduced on (GPU only)."""
        self._comm = comm
        self._gpu, self._stream = side if side is not None else (None, None)
        self._meter = meter
        self._combine = combine
        self._scales = scales or {}
        self._bucket_bytes = bucket_bytes
        self._first_bytes = bucket_bytes if first_bucket_bytes is None else min(bucket_bytes, first_bucket_bytes)
        self._flushed: set[tuple[int, ...]] = set()
        self._pending: dict[tuple[int, ...], list[torch.Tensor]] = defaultdict(list)
        self._filled: dict[tuple[int, ...], int] = defaultdict(int)
        """Bytes in each pending bucket, kept as gradients join (summing the bucket on every add is quadratic)."""
        self._inflight: list[tuple[Waitable, tuple[int, ...], torch.Tensor, list[torch.Tensor]]] = []

    def add(self, ranks: tuple[int, ...], grads: list[torch.Tensor]) -> None:
        """Queue a layer's gradients for summing over ``ranks``."""
        if not grads:
            return
        if self._combine is Combine.ADASUM:
            self._adasum(ranks, grads)
            return
        self._pending[ranks].extend(grads)
        self._filled[ranks] += sum(g.numel() * g.element_size() for g in grads)
        limit = self._bucket_bytes if ranks in self._flushed else self._first_bytes
        if self._filled[ranks] >= limit:
            self._flush(ranks)
            if self._bucket_bytes == 0:
                self._wait()

    def finish(self) -> None:
        """Reduce what is queued and wait for every bucket; gradients then hold the sums."""
        for ranks in sorted(self._pending, key=lambda r: (len(r), r)):
            self._flush(ranks)
        self._wait()
        self._flushed.clear()

    def _wait(self) -> None:
        inflight, self._inflight = self._inflight, []
        for handle, ranks, flat, grads in inflight:
            handle.wait()
            if self._gpu is not None and self._stream is not None:
                current = self._gpu.current_stream(flat.device)
                current.wait_stream(self._stream)
                self._gpu.record_stream(flat, current)
            if self._meter is not None:
                self._meter.after(ranks, flat)
            if len(grads) == 1:
                continue
            for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                grad.copy_(summed)

    def _flush(self, ranks: tuple[int, ...]) -> None:
        grads = self._pending.pop(ranks, [])
        self._filled.pop(ranks, None)
        if not grads:
            return
        self._flushed.add(ranks)
        if self._gpu is None or self._stream is None:
            self._launch(ranks, grads)
            return
        self._stream.wait_stream(self._gpu.current_stream(grads[0].device))
        with self._gpu.use(self._stream):
            self._launch(ranks, grads)

    def _launch(self, ranks: tuple[int, ...], grads: list[torch.Tensor]) -> None:
        flat = grads[0] if len(grads) == 1 else _flatten_dense_tensors(grads)
        if self._meter is not None:
            self._meter.before(ranks, flat)
        def launch() -> Waitable:
            return self._comm.all_reduce(flat, ranks, async_op=True)

        handle = launch() if self._gpu is None else self._gpu.collective(launch, [flat])
        self._inflight.append((handle, ranks, flat, grads))

    def _adasum(self, ranks: tuple[int, ...], grads: list[torch.Tensor]) -> None:
        """One layer's gradients, in place: the Adasum of the ranks' own mean gradients."""
        flat = _flatten_dense_tensors(grads) * self._scales[ranks]
        adasum_exchange(flat, ranks, self._comm.rank, self._comm.exchange)
        for grad, combined in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
            grad.copy_(combined)
