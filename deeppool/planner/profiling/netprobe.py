"""Measure this machine's network for the cost model: gloo all-reduce and point-to-point.

The one module of the planner that imports ``torch.distributed`` (``tests/test_layering.py``).
:func:`probe_network` starts ``nproc`` processes (``torch.multiprocessing``,
spawn) that talk over gloo as the executor's ranks do (point-to-point in one
``batch_isend_irecv``, all-reduces on a process group per rank set) and time,
at each message size:

- point-to-point: a ping-pong between ranks 0 and 1 (``batch_isend_irecv``, as a
  reshard moves activations), half the round trip;
- all-reduce of a float32 tensor over ranks ``0..g-1`` for every ``g`` in
  ``2..nproc``, each after the ranks computed together (as a layer's gradients
  are summed at the end of the backward: see the wake-up below);
- at the smallest size, for every ``g`` in ``2..nproc``: ranks ``0..g-1``
  compute the same fixed work (``busy_ms`` of it on rank 0 alone), then ranks
  ``1..g-1`` each send rank 0 a message (as a stage on ``g`` ranks computes,
  then hands its output or its input gradients to a one-rank stage, or sums its
  gradients): what rank 0 waits beyond one plain message is the
  synchronisation latency ``ω_w(g)`` (on a host whose cores the ranks share,
  gloo's threads must be scheduled again on cores the compute held, and ranks
  time-sliced on them finish the same work apart). Fixed work, not a fixed
  time: compute that ends by the clock ends on every rank at once and hides
  the second part (``docs/notes/0006-network-probe-means-after-compute.md``).

Every figure is the mean over repeats after a warm-up, each repeat started
after a barrier (the mean, since the iteration pays it: see :func:`_timed`).
Each pattern is then fitted to the cost model's own formula
(:mod:`deeppool.planner.solve.cost`):

    point-to-point(n)   = α + n / BW                              (one side of a reshard)
    all-reduce(g, W)    = 2(g−1)/g · W / (η·BW) + 2⌈log₂ g⌉ · λ·α

by least squares on relative error (each sample weighted by 1/time, so small
and large messages count alike), with ``α ≥ 0``. On gloo over loopback the two
patterns do not share one bandwidth (an all-reduce also sums on the CPU), so
α and BW come from the point-to-point fit and the all-reduce fit becomes the
efficiency η and latency factor λ. The file also records the joint fit and
every sample (``measured``). The result is a
:class:`~deeppool.planner.hardware.NetworkModel` for one host: in-node and
cross-node figures are both the measured ones (cross-host links are not
measured; override them with ``deeppool plan --inter-gbps``).
"""

from __future__ import annotations

import datetime
import enum
import functools
import math
import os
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deeppool.errors import DeeppoolError
from deeppool.interrupt import children_start_deaf, die_on_interrupt
from deeppool.plans import NETWORK_SCHEMA_VERSION, NetworkModel
from deeppool.plans.jsonio import read_json, write_json
from deeppool.planner.hardware import LOCAL_NETWORK
from deeppool.planner.profiling.netprobe_config import DEFAULT_SIZES, ProbeConfig


class Pattern(enum.Enum):
    P2P = "p2p"
    ALLREDUCE = "allreduce"
    WAKEUP = "wakeup"
    """Ranks ``1..g-1`` send to rank 0 after all ``g`` computed together (``ranks`` is ``g``): not
    fitted; what rank 0 waits beyond one plain message is the synchronisation latency ``ω_w(g)``."""
    SKEW = "skew"
    """The all-reduce after ``SKEW_FACTOR`` times the compute: not fitted; what it takes beyond the
    all-reduce after the usual compute, per second of the extra compute, is the skew's slope."""


SKEW_FACTOR = 3
"""The skew samples compute this many times ``busy_ms`` before their all-reduce."""
SKEW_BUDGET = 10.0
"""The skew's pairs run this many times the time of one plain sample (4 s by default, about 90 pairs): it
is a small difference of two noisy means. Measured at the smallest size only: the skew is when the ranks
arrive, not what they send, and a large all-reduce's own spread hides it
(``docs/notes/0101-skew-probe-paired-at-the-smallest-size.md``)."""


@dataclass(frozen=True, kw_only=True)
class Sample:
    """One timed pattern: ``ranks`` taking part, ``nbytes`` per message, mean ``seconds``."""

    pattern: Pattern
    ranks: int
    nbytes: int
    seconds: float
    busy_s: float = 0.0
    """The compute the ranks did together before the timed call (0: none)."""

    def terms(self) -> tuple[float, float]:
        """The sample's coefficients of (α, 1/BW) in the cost model's formula."""
        if self.pattern is not Pattern.ALLREDUCE:
            return 1.0, float(self.nbytes)
        g = self.ranks
        return 2.0 * math.ceil(math.log2(g)), 2.0 * (g - 1) / g * self.nbytes

    def to_json(self) -> dict[str, Any]:
        return {"pattern": self.pattern.value, "ranks": self.ranks, "bytes": self.nbytes, "seconds": self.seconds,
                "busy_s": self.busy_s}


@dataclass(frozen=True, kw_only=True)
class NetworkFit:
    """The fitted latency and bandwidth, and the samples they came from."""

    latency_s: float
    bandwidth: float
    samples: tuple[Sample, ...]
    nproc: int

    def predict(self, sample: Sample) -> float:
        """The cost model's seconds for ``sample`` with the :attr:`network` it was fitted to."""
        network = self.network
        if sample.pattern is Pattern.ALLREDUCE:
            return network.allreduce_s(sample.ranks, sample.nbytes)
        if sample.pattern is Pattern.SKEW:
            extra = sample.busy_s - network.skew_after_s
            return network.allreduce_s(sample.ranks, sample.nbytes) + network.skew_per_s(sample.ranks) * extra
        one_way = network.intra_latency_s + sample.nbytes / network.intra_bandwidth
        return one_way + (network.sync_latency_s(sample.ranks) if sample.pattern is Pattern.WAKEUP else 0.0)

    @property
    def network(self) -> NetworkModel:
        """Point-to-point figures, with all-reduce's own fit as its efficiency and latency factor."""
        p2p = _figures(self.samples, Pattern.P2P, self.nproc)
        reduce = _figures(self.samples, Pattern.ALLREDUCE, self.nproc)
        if p2p is None or reduce is None:
            return NetworkModel.flat(
                gpus_per_node=LOCAL_NETWORK.gpus_per_node, bandwidth=self.bandwidth, latency_s=self.latency_s,
                allreduce_overlap=LOCAL_NETWORK.allreduce_overlap,
            )
        bandwidth, latency = p2p["bandwidth"], p2p["latency_s"]
        sync = sync_latencies(self.samples)
        return NetworkModel.flat(
            gpus_per_node=LOCAL_NETWORK.gpus_per_node, bandwidth=bandwidth, latency_s=latency,
            allreduce_overlap=LOCAL_NETWORK.allreduce_overlap,
            allreduce_efficiency=reduce["bandwidth"] / bandwidth,
            allreduce_latency_factor=reduce["latency_s"] / latency if latency > 0 else 1.0,
            wakeup_s=sync.get(2, 0.0), sync_s=sync, skew=skews(self.samples),
            skew_after_s=max((s.busy_s for s in self.samples if s.pattern is Pattern.ALLREDUCE), default=0.0),
        )

    def to_json(self) -> dict[str, Any]:
        """The NetworkModel file (``artifact: network``), with how it was measured."""
        return {
            "artifact": "network",
            "schema_version": NETWORK_SCHEMA_VERSION,
            **self.network.to_json(),
            "measured": {
                "nproc": self.nproc,
                "backend": "gloo",
                "host": socket.gethostname(),
                "cpus": os.cpu_count(),
                "samples": [s.to_json() | {"fitted_seconds": self.predict(s)} for s in self.samples],
                "per_pattern": {pattern.value: _figures(self.samples, pattern, self.nproc)
                                for pattern in (Pattern.P2P, Pattern.ALLREDUCE)},
                "sync_s": {str(g): value for g, value in sync_latencies(self.samples).items()},
                "skew": {str(g): value for g, value in skews(self.samples).items()},
            },
        }

    def save(self, path: str | Path) -> None:
        write_json(path, self.to_json())


def sync_latencies(samples: Sequence[Sample]) -> dict[int, float]:
    """``ω_w(g)`` by rank count: what rank 0 waited for the messages of ranks that computed with it,
    beyond one plain message of that size (at least 0)."""
    plain = {s.nbytes: s.seconds for s in samples if s.pattern is Pattern.P2P}
    return {s.ranks: max(0.0, s.seconds - plain[s.nbytes])
            for s in samples if s.pattern is Pattern.WAKEUP and s.nbytes in plain}


def skews(samples: Sequence[Sample]) -> dict[int, float]:
    """The skew's slope by rank count: what an all-reduce after the long compute took beyond the same
    all-reduce after the usual compute, per second of the extra compute, averaged over the sizes both
    measured (at least 0)."""
    usual = {(s.ranks, s.nbytes): s for s in samples if s.pattern is Pattern.ALLREDUCE}
    slopes: dict[int, list[float]] = {}
    for s in samples:
        base = usual.get((s.ranks, s.nbytes))
        if s.pattern is Pattern.SKEW and base is not None and s.busy_s > base.busy_s:
            slopes.setdefault(s.ranks, []).append((s.seconds - base.seconds) / (s.busy_s - base.busy_s))
    return {ranks: max(0.0, statistics.fmean(values)) for ranks, values in sorted(slopes.items())}


def fit(samples: Sequence[Sample], *, nproc: int) -> NetworkFit:
    """Least squares on relative error for (α, 1/BW), α clamped at 0 (wake-up samples left out)."""
    rows = [(*s.terms(), s.seconds) for s in samples if s.seconds > 0 and s.pattern in (Pattern.P2P, Pattern.ALLREDUCE)]
    if not rows:
        raise DeeppoolError("the network probe measured nothing: check --sizes")
    weighted = np.array([(a / t, b / t) for a, b, t in rows])  # each row's target becomes 1
    ones = np.ones(len(rows))
    (alpha, per_byte), *_ = np.linalg.lstsq(weighted, ones, rcond=None)
    if alpha < 0 or per_byte <= 0:
        alpha, per_byte = 0.0, float(weighted[:, 1] @ ones / (weighted[:, 1] @ weighted[:, 1]))
    return NetworkFit(latency_s=float(alpha), bandwidth=1.0 / float(per_byte), samples=tuple(samples), nproc=nproc)


def _figures(samples: Sequence[Sample], pattern: Pattern, nproc: int) -> dict[str, float] | None:
    """The fit to one pattern alone (for a cost model with a bandwidth per pattern)."""
    chosen = [s for s in samples if s.pattern is pattern]
    if not chosen:
        return None
    alone = fit(chosen, nproc=nproc)
    return {"latency_s": alone.latency_s, "bandwidth": alone.bandwidth}


Launcher = Callable[[ProbeConfig], list[Sample]]


def probe_network(config: ProbeConfig, *, launcher: Launcher | None = None) -> NetworkFit:
    """Measure with ``config`` (``launcher`` starts the processes; tests inject one) and fit."""
    samples = (launcher or spawn_probe)(config)
    return fit(samples, nproc=config.nproc)


@dataclass(frozen=True, kw_only=True)
class LocalNetwork:
    """This host's network for a plan's ranks (:func:`local_network`) and where it came from."""

    model: NetworkModel
    path: Path | None
    """The cache file it was read from or written to; None with no cache."""
    measured_now: bool


def local_network(nproc: int, cache_dir: Path | None, *, say: Callable[[str], None] = lambda _: None,
                  launcher: Launcher | None = None) -> LocalNetwork:
    """This host's network for ``nproc`` gloo ranks: from ``cache_dir`` where a probe of this host (its name and
    cores) at that count left it, else measured now (the probe's defaults, as ``deeppool profile-network
    --nproc N`` measures, after ``say`` says so; ``launcher`` as :func:`probe_network`'s) and kept there."""
    path = cache_dir / f"network-gloo-{nproc}.json" if cache_dir is not None else None
    cached = _probed_here(path, nproc) if path is not None else None
    if cached is not None:
        return LocalNetwork(model=cached, path=path, measured_now=False)
    say(f"measuring this host's network with {nproc} gloo processes (once: it is kept)")
    fitted = probe_network(ProbeConfig(nproc=nproc), launcher=launcher)
    if path is not None:
        fitted.save(path)
    return LocalNetwork(model=fitted.network, path=path, measured_now=True)


def _probed_here(path: Path, nproc: int) -> NetworkModel | None:
    """The network in ``path`` where this host measured it with ``nproc`` processes; None for anything else
    (a missing, foreign or damaged file), which is measured again."""
    try:
        payload = read_json(path, kind="network", schema_version=NETWORK_SCHEMA_VERSION)
        measured = payload["measured"]
        here = (measured.get("host"), measured.get("cpus"), measured.get("nproc")) == (
            socket.gethostname(), os.cpu_count(), nproc)
        return NetworkModel.from_json(payload) if here else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, DeeppoolError):
        return None


def measure_network(nproc: int, sizes: Sequence[int] = DEFAULT_SIZES) -> NetworkModel:
    """This host's NetworkModel, measured with ``nproc`` gloo processes at ``sizes`` bytes."""
    return probe_network(ProbeConfig(nproc=nproc, sizes=tuple(sizes))).network


def spawn_probe(config: ProbeConfig) -> list[Sample]:
    """Run the probe on ``config.nproc`` spawned processes; rank 0's samples."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    with children_start_deaf():  # a Ctrl-C while they import would print a traceback per rank
        ranks = mp.start_processes(_rank_main, args=(config, port, results), nprocs=config.nproc, join=False,
                                   start_method="spawn")
    try:
        while not ranks.join():
            pass
    except BaseException:  # Ctrl-C: a rank still importing ignores it (it started deaf), so end them all here
        for process in ranks.processes:
            process.kill()
        raise
    return list(results.get())


def _rank_main(rank: int, config: ProbeConfig, port: int, results: Any) -> None:
    die_on_interrupt()
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=config.nproc,
        timeout=datetime.timedelta(seconds=config.timeout_s),
    )
    groups = [tuple(range(g)) for g in range(2, config.nproc + 1)]
    comm = _Peers(groups, timeout_s=config.timeout_s)
    samples = []
    matmuls = _calibrated(config.busy_ms / 1e3)
    busy_s = config.busy_ms / 1e3
    for nbytes in config.sizes:
        tensor = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
        samples.append(Sample(pattern=Pattern.P2P, ranks=2, nbytes=tensor.numel() * 4,
                              seconds=_timed(config, lambda t=tensor: _ping_pong(comm, t)) / 2))
        if nbytes == min(config.sizes):
            for ranks in groups:
                seconds = _timed(config, lambda t=tensor, g=len(ranks): _gather(comm, t, g), busy=len(ranks),
                                 matmuls=matmuls, budget=3.0)  # its tail is most of it: three times the repeats
                samples.append(Sample(pattern=Pattern.WAKEUP, ranks=len(ranks), nbytes=tensor.numel() * 4,
                                      seconds=seconds, busy_s=busy_s))
        for ranks in groups:
            reduce = functools.partial(_all_reduce, comm, tensor, ranks)
            if nbytes == min(config.sizes):
                seconds, skewed = _timed_pair(config, reduce, busy=len(ranks), matmuls=matmuls)
                samples.append(Sample(pattern=Pattern.SKEW, ranks=len(ranks), nbytes=tensor.numel() * 4,
                                      seconds=skewed, busy_s=SKEW_FACTOR * busy_s))
            else:
                seconds = _timed(config, reduce, busy=len(ranks), matmuls=matmuls)
            samples.append(Sample(pattern=Pattern.ALLREDUCE, ranks=len(ranks), nbytes=tensor.numel() * 4,
                                  seconds=seconds, busy_s=busy_s))
    if rank == 0:
        results.put(samples)
    dist.barrier()
    dist.destroy_process_group()


class _Peers:
    """What the probe sends through, as the executor's ranks send: point-to-point moves in one
    ``batch_isend_irecv`` (as a reshard), and blocking all-reduces on a process group per rank set, made up
    front in the same order on every rank (``new_group`` is collective), as the gradients' groups are."""

    def __init__(self, groups: Sequence[tuple[int, ...]], *, timeout_s: float) -> None:
        import torch.distributed as dist

        self.rank = dist.get_rank()
        timeout = datetime.timedelta(seconds=timeout_s)
        self._groups = {ranks: dist.new_group(list(ranks), timeout=timeout)
                        for ranks in sorted(set(groups), key=lambda r: (len(r), r))}

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Send and receive these tensors (in this order per peer) and wait for all."""
        import torch.distributed as dist

        ops = [dist.P2POp(dist.isend, tensor, peer) for peer, tensor in sends]
        ops += [dist.P2POp(dist.irecv, tensor, peer) for peer, tensor in recvs]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def all_reduce(self, tensor: torch.Tensor, ranks: tuple[int, ...]) -> None:
        """Sum ``tensor`` in place over ``ranks`` (a group made at construction)."""
        import torch.distributed as dist

        dist.all_reduce(tensor, group=self._groups[ranks])


def _ping_pong(comm: _Peers, tensor: torch.Tensor) -> None:
    if comm.rank == 0:
        comm.exchange([(1, tensor)], [])
        comm.exchange([], [(1, tensor)])
    elif comm.rank == 1:
        comm.exchange([], [(0, tensor)])
        comm.exchange([(0, tensor)], [])


def _gather(comm: _Peers, tensor: torch.Tensor, ranks: int) -> None:
    """Ranks ``1..ranks-1`` each send ``tensor`` to rank 0, which receives them all."""
    if comm.rank == 0:
        comm.exchange([], [(peer, torch.empty_like(tensor)) for peer in range(1, ranks)])
    elif comm.rank < ranks:
        comm.exchange([(0, tensor)], [])


def _all_reduce(comm: _Peers, tensor: torch.Tensor, ranks: tuple[int, ...]) -> None:
    if comm.rank in ranks:
        comm.all_reduce(tensor, ranks)


def _timed(config: ProbeConfig, work: Callable[[], Any], *, busy: int = 0, matmuls: int = 0,
           budget: float = 1.0) -> float:
    """Mean seconds of ``work`` on this rank, each repeat after a barrier; ranks below ``busy`` first
    compute ``matmuls`` (:func:`_compute`, the clock starts after); ``budget`` scales the time spent.

    The mean, not the median: on a host whose cores the ranks share, a small collective is slow
    in a fraction of its calls, and an iteration of many collectives pays the mean
    (``docs/notes/0006-network-probe-means-after-compute.md``). After ``config.repeats`` repeats every rank takes the slowest rank's figures so far and
    runs as many more as make about ``config.min_seconds`` (at most ``config.max_repeats``), so all
    ranks agree on the count."""
    for _ in range(config.warmup):
        _repeat(work, busy, matmuls)
    times = [_repeat(work, busy, matmuls) for _ in range(config.repeats)]
    total = _agreed_total(config, sum(times) / len(times) + bool(busy) * config.busy_ms / 1e3, budget)
    times += [_repeat(work, busy, matmuls) for _ in range(total - len(times))]
    return statistics.fmean(times)


def _timed_pair(config: ProbeConfig, work: Callable[[], Any], *, busy: int, matmuls: int) -> tuple[float, float]:
    """Mean seconds of ``work`` after ``matmuls`` and after ``SKEW_FACTOR`` times as many, their repeats
    interleaved (in alternating order) for ``SKEW_BUDGET`` times the usual time.

    Interleaved, as the skew is their difference: on shared cores a core can compute slower for
    stretches of a fraction of a second, and two samples taken a second apart would see different
    stretches (``docs/notes/0007-skew-priced.md``, ``docs/notes/0101-skew-probe-paired-at-the-smallest-size.md``)."""
    for _ in range(config.warmup):
        _repeat(work, busy, matmuls)
        _repeat(work, busy, SKEW_FACTOR * matmuls)
    pairs = [_pair(work, busy, matmuls, i) for i in range(config.repeats)]
    mean_pair = sum(usual + long for usual, long in pairs) / len(pairs)
    total = _agreed_total(config, mean_pair + (1 + SKEW_FACTOR) * config.busy_ms / 1e3, SKEW_BUDGET)
    pairs += [_pair(work, busy, matmuls, i) for i in range(len(pairs), total)]
    return statistics.fmean(u for u, _ in pairs), statistics.fmean(long for _, long in pairs)


def _pair(work: Callable[[], Any], busy: int, matmuls: int, index: int) -> tuple[float, float]:
    """One repeat of each: after ``matmuls``, after ``SKEW_FACTOR`` times as many (the order alternating)."""
    if index % 2:
        long = _repeat(work, busy, SKEW_FACTOR * matmuls)
        return _repeat(work, busy, matmuls), long
    usual = _repeat(work, busy, matmuls)
    return usual, _repeat(work, busy, SKEW_FACTOR * matmuls)


def _agreed_total(config: ProbeConfig, seconds_per_repeat: float, budget: float) -> int:
    """How many repeats make about ``budget × min_seconds`` (within ``repeats..max_repeats``), from the
    slowest rank's seconds per repeat so far (a collective: every rank gets the same count)."""
    import torch.distributed as dist

    slowest = torch.tensor([seconds_per_repeat], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    per_repeat = max(float(slowest), 1e-6)
    return min(config.max_repeats, max(config.repeats, math.ceil(budget * config.min_seconds / per_repeat)))


def _repeat(work: Callable[[], Any], busy: int, matmuls: int) -> float:
    """One timed repeat after a barrier (ranks below ``busy`` computing ``matmuls`` first)."""
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() < busy:
        _compute(matmuls)
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def _compute(matmuls: int) -> None:
    """A stage's compute: a fixed amount of work (``matmuls`` 256×256 matmuls), not a fixed time, so that
    ranks time-sliced on shared cores finish it apart, as the ranks of a stage finish its backward."""
    matrix = torch.ones(256, 256)
    for _ in range(matmuls):
        torch.mm(matrix, matrix)


def _calibrated(seconds: float) -> int:
    """How many of :func:`_compute`'s matmuls take ``seconds`` on rank 0 alone (the other ranks wait),
    the same count on every rank."""
    import torch.distributed as dist

    count = torch.zeros(1, dtype=torch.int64)
    dist.barrier()
    if dist.get_rank() == 0:
        _compute(10)
        began = time.perf_counter()
        _compute(100)
        count[0] = max(1, round(100 * seconds / max(time.perf_counter() - began, 1e-9)))
    dist.broadcast(count, src=0)
    return int(count[0])
