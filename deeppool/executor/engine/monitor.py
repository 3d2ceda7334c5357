"""The gradient noise scale measured while training (``--monitor gns``), and AdaScale's learning rate.

A layer group is the rank set ``(0 … g−1)`` a layer's gradients are summed
over. Before its all-reduce, rank ``r`` holds ``ℓ_r = (n_r/B)·ḡ_r``: the loss
is pre-scaled by ``n_r/B`` (:mod:`deeppool.executor.engine.engine`), and ``ḡ_r`` is
the mean gradient over the rank's ``n_r`` samples. After it, every member
holds the mean gradient over the global batch, ``G_B = Σ_r ℓ_r``. With ``K``
micro-batches per step (``--accumulate``) the loss is also divided by ``K``
and the gradients summed, so ``ℓ_r`` is ``n_r/B`` times the mean over the
rank's ``K·n_r`` samples and ``G_B`` the mean over ``K·B``: the small batch is
``b_r = K·n_r``, the large ``K·B``. So, per group and rank,

    |G_small|² = (B / n_r)² · |ℓ_r|²        (a mean over b_r samples)
    |G_big|²   = |G_B|²                      (a mean over K·B samples)

and McCandlish's unbiased estimators (:class:`deeppool.adaptation.gns.GroupNorms`)
give the rank's ``|G|²`` and ``tr(Σ)`` for the group's parameters. Each rank
computes its own pair once the group's gradients are reduced; one all-reduce
of ``[|G|², tr(Σ), 1]`` per group (groups in order of size, so every member
issues them in one order) gives the group's mean over its ranks, unbiased
also when the ranks hold different ``n_r``. Rank 0 is in every group: it adds
the groups up (both statistics add over parameter blocks) and updates the
:class:`~deeppool.adaptation.gns.NoiseScale` moving averages. Groups of one
GPU have a single batch size and are left out (:attr:`GnsReading.skipped`
counts them), as are their parameters.

:class:`GradientMonitor` is the state: :attr:`GradientMonitor.latest` is the
newest :class:`GnsReading` on rank 0 (None elsewhere, and before the first
step). :class:`AdaScaleLr` sets the learning rate from it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from deeppool.adaptation.adascale import AdaScale
from deeppool.adaptation.gns import GroupNorms, NoiseScale, StepEstimate
from deeppool.executor.config import Schedule
from deeppool.executor.engine.comm import Comm
from deeppool.model.graph import LayerGraph
from deeppool.plans import Plan, sample_ranges

Ranks = tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class GroupShare:
    """This rank's part of one layer group: its samples and the group's, per optimizer step."""

    ranks: Ranks
    rows: int
    batch: int

    @property
    def scale(self) -> float:
        """``B / n_r``: turns the rank's pre-scaled gradient into its own mean gradient."""
        return self.batch / self.rows


def group_shares(plan: Plan, graph: LayerGraph, rank: int, accumulate: int = 1) -> tuple[GroupShare, ...]:
    """The groups of two or more ranks that reduce parameters and hold ``rank``, smallest first."""
    gpus = {layer.name: layer.gpus for layer in plan.layers}
    sizes = sorted({gpus[layer.name] for layer in graph.layers if layer.params and gpus[layer.name] > 1})
    shares = []
    for size in (s for s in sizes if rank < s):
        start, end = sample_ranges(plan.global_batch, size)[rank]
        shares.append(GroupShare(ranks=tuple(range(size)), rows=accumulate * (end - start),
                                 batch=accumulate * plan.global_batch))
    return tuple(shares)


def single_groups(plan: Plan, graph: LayerGraph) -> int:
    """Layers with parameters on one GPU: left out of the estimate."""
    gpus = {layer.name: layer.gpus for layer in plan.layers}
    return sum(1 for layer in graph.layers if layer.params and gpus[layer.name] == 1)


class NormMeter:
    """Squared gradient norms per group in one step: this rank's before the all-reduce, the reduced after.

    :class:`~deeppool.executor.engine.gradients.GradientReducer` calls :meth:`before` on every bucket it
    launches and :meth:`after` on every bucket it has waited for.
    """

    def __init__(self) -> None:
        self._local: dict[Ranks, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
        self._reduced: dict[Ranks, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))

    def before(self, ranks: Ranks, flat: torch.Tensor) -> None:
        self._local[ranks] = self._local[ranks].to(flat.device) + flat.detach().double().pow(2).sum()

    def after(self, ranks: Ranks, flat: torch.Tensor) -> None:
        self._reduced[ranks] = self._reduced[ranks].to(flat.device) + flat.detach().double().pow(2).sum()

    def take(self, ranks: Ranks) -> tuple[float, float]:
        """``(|ℓ_r|², |G_B|²)`` of the group this step, and forget them."""
        local, reduced = self._local.pop(ranks, None), self._reduced.pop(ranks, None)
        return (0.0 if local is None else float(local)), (0.0 if reduced is None else float(reduced))


@dataclass(frozen=True, kw_only=True)
class GnsReading:
    """One step's noise-scale figures on rank 0: the step's raw estimates and the moving averages."""

    step: int
    grad_sq: float
    """This step's unbiased |G|², summed over the groups."""
    trace: float
    """This step's unbiased tr(Σ) (per-sample variance, summed over coordinates)."""
    grad_sq_ema: float
    trace_ema: float
    noise_scale: float
    """``EMA(tr Σ) / EMA(|G|²)``, in samples."""
    groups: int
    skipped: int
    per_group: tuple[tuple[int, float, float], ...] = ()
    """``(group size, |G|², tr Σ)`` of this step, per group: the parts that add up to ``grad_sq`` and ``trace``."""

    def to_json(self) -> dict[str, Any]:
        scalars = ("step", "grad_sq", "trace", "grad_sq_ema", "trace_ema", "noise_scale", "groups", "skipped")
        return {key: _finite(getattr(self, key)) for key in scalars}


class GradientMonitor:
    """The gradient noise scale of a run (``--monitor gns``): measured every optimizer step.

    Every rank holds one; only rank 0's (in every group) sees the whole model, so
    :attr:`latest` and :attr:`noise_scale` are rank 0's figures and None/empty elsewhere.
    """

    def __init__(self, comm: Comm, shares: tuple[GroupShare, ...], *, skipped: int, device: torch.device,
                 smoothing: float = 0.1) -> None:
        self.comm = comm
        self.device = device
        self.shares = shares
        self.skipped = skipped
        self.meter = NormMeter()
        self.noise_scale = NoiseScale(smoothing)
        self.latest: GnsReading | None = None

    def observe(self, step: int) -> GnsReading | None:
        """After the step's gradients are reduced: estimate per group, combine on rank 0, update the EMAs."""
        sums = [self._group_mean(share) for share in self.shares]
        if self.comm.rank != 0 or not sums:
            return None
        estimate = StepEstimate(grad_sq=sum(s[0] for s in sums), trace=sum(s[1] for s in sums), groups=len(sums),
                                skipped=self.skipped)
        self.noise_scale.update(estimate)
        self.latest = GnsReading(
            step=step, grad_sq=estimate.grad_sq, trace=estimate.trace, grad_sq_ema=self.noise_scale.grad_sq,
            trace_ema=self.noise_scale.trace, noise_scale=self.noise_scale.value, groups=estimate.groups,
            skipped=estimate.skipped,
            per_group=tuple((len(share.ranks), sq, trace) for share, (sq, trace) in zip(self.shares, sums, strict=True)),
        )
        return self.latest

    def _group_mean(self, share: GroupShare) -> tuple[float, float]:
        local_sq, reduced_sq = self.meter.take(share.ranks)
        norms = GroupNorms(small_sq=share.scale**2 * local_sq, small_batch=share.rows, large_sq=reduced_sq,
                           large_batch=share.batch)
        values = torch.tensor([norms.grad_sq(), norms.trace(), 1.0], dtype=torch.float64, device=self.device)
        self.comm.all_reduce(values, share.ranks)
        count = float(values[2])
        return float(values[0]) / count, float(values[1]) / count

    def state_dict(self) -> dict[str, float]:
        return self.noise_scale.state_dict()

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.noise_scale.load_state_dict(state)


class AdaScaleLr:
    """Sets every rank's learning rate to AdaScale's ``gain^p · lr · schedule(τ)`` each optimizer step.

    ``p`` is 1 for SGD and ½ for Adam (:class:`deeppool.adaptation.adascale.AdaScale`). Rank 0
    computes the gain from the monitor's moving averages; one all-ranks maximum (every other rank
    offers 0, the gain is at least 1) hands it to every rank, so τ advances identically everywhere.
    """

    def __init__(self, scaler: AdaScale, *, lr: float, schedule: Schedule, monitor: GradientMonitor) -> None:
        self.scaler = scaler
        self.lr = lr
        self.schedule = schedule
        self.monitor = monitor

    def apply(self, optimizer: torch.optim.Optimizer | None) -> float:
        """Before the optimizer steps: the gain, τ and the learning rate of this step; returns the LR."""
        noise = self.monitor.noise_scale
        mine = self.scaler.gain_for(noise.trace, noise.grad_sq) if self.monitor.comm.rank == 0 else 0.0
        gain = self.monitor.comm.all_reduce_max(mine)
        lr = self.scaler.advance(gain, lambda tau: self.lr * self.schedule.factor(tau))
        for group in optimizer.param_groups if optimizer is not None else ():
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict[str, float]:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scaler.load_state_dict(state)


def _finite(value: float | int) -> float | int | None:
    return value if math.isfinite(value) else None
