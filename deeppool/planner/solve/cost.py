"""The one cost model of deeppool: planner, baselines, simulator and reports import it.

A plan gives every layer ``l`` a GPU count ``g_l``; the layer runs on ranks
``0..g_l-1`` and rank ``i`` holds samples ``[⌊i·B/g⌋, ⌊(i+1)·B/g⌋)`` of the
global batch ``B`` (uneven splits allowed), so the per-GPU batch is
``s(g) = ⌈B/g⌉``. Bytes follow the plan's precision ``p``: per-sample
activation bytes ``A_l`` and parameter bytes ``W_l`` are the traced ones
rescaled from the traced dtype's element size to ``p``'s (integer tensors
keep theirs). ``AR(g, S, k)`` is the network's hierarchical all-reduce of
``S`` bytes over ranks 0..g-1 paying ``k`` latency rounds
(:meth:`NetworkModel.allreduce_s`: NVLink ring inside a node, all NICs of
each node across). The predicted iteration time is

    T = Σ_l [ fwd_l(s) + bwd_l(s) + BN_l(g_l) + AR*_l(g_l) + OPT_l ] + LOSS(g_out)
        + Σ_(u→v) [ R_u(g_u → g_v) + R_u(g_v → g_u) ] + Σ_g [ ROUNDS(g) + SKEW(g) ] + OPT_call

    AR*_l(g)  gradient all-reduce as the executor does it (``--bucket-mb``, default 25 MiB):
              gradients are copied into a flat bucket per rank group and the sums
              copied back; a full bucket is reduced asynchronously while the
              backward goes on; the last bucket (the first layers, whose gradients
              come last) waits at the end. Its bytes, per layer:
                = 0                                           if g = 1 or W_l = 0
                = AR(g, W_l, 1) + CP_l                        with bucket 0 (one synchronous call per layer)
                = AR(g, W_l, 0) + CP_l                        if l is in the last bucket
                = max(0, AR(g, W_l, 0) + CP_l − ω·bwd_l)      otherwise (hidden behind the backward;
                                                             ω the network's overlap: 1 on GPUs, 0 for gloo on CPUs)
              with the last bucket the layers whose forward-order prefix of
              parameter bytes is below ``Σ W mod bucket`` (a whole bucket if 0).
    ROUNDS(g) = AR(g, 0, max(1, (1 − ω)·S_g / b))   for each count g > 1 that holds parameters
              (S_g the parameter bytes of the layers on g ranks, b the bucket): every rank
              group reduces its own buckets, and each all-reduce pays the latency rounds;
              the last one is always exposed, the others hide behind the backward as far as
              ω lets them. It is reported on the group's first layer with parameters
              (its gradients come last), in that layer's all-reduce.
    SKEW(g)   = κ(g) · max(0, C_g − c_probe)   for each count g > 1 that runs a layer, with C_g the
              compute (fwd + bwd) of the layers on g ranks: ranks time-sliced on shared cores finish
              the same work further apart the longer it is, and the group's collective at the end of
              its backward waits for the last; κ(g) and c_probe, the compute the probe ran before its
              collectives (whose wait the all-reduce and ω_w figures already hold), are measured by
              ``deeppool profile-network`` (:attr:`NetworkModel.skew`; 0 on GPUs and for the presets).
              Reported with ROUNDS(g) (on the group's first layer with parameters, else its first).
    CP_l      = 4 · W_l / BW_mem   (the reducer flattens the gradients into the bucket, reading and
              writing W_l, and copies the sums back, reading and writing W_l again; 0 for a layer
              with one parameter tensor under bucket 0, reduced in place; BW_mem from the profile)
    BN_l(g)   = AR(g, 8(C+1), 1) + AR(g, 8C, 1)  (forward)  +  AR(g, 16C, 1)  (backward)
              for an ``nn.BatchNorm`` layer on g > 1 ranks (C channels): the executor's
              synchronised BatchNorm reduces count and sum, then squared deviations,
              then Σdy and Σdy·(x−μ), in float64, synchronously; a plan's
              ``fwd_ms``/``bwd_ms`` include these. The group BatchNorm's own arithmetic (float64
              sums, several passes over the activations where the fused kernel makes one) is
              in ``fwd_l``/``bwd_l`` on ``g > 1``: a measured profile times the layer that way
              (:attr:`Profile.grouped`); an estimate does not.
    R_u(a → b) = 0 if a = b, else σ(min(a, b)) + ω_w(a)·[a > 1]
              (``u``'s activations resharded forward from ``g_u`` to ``g_v`` ranks, their
              gradients backward from ``g_v`` to ``g_u``; the busiest rank moves one shard of
              the smaller group over the slowest link the pair crosses: NVLink inside a
              node, the GPU's NIC share across nodes, ``σ(g) = α + A_u · s(g) / BW``;
              ω_w(a) the network's synchronisation latency, paid when the sending side is a
              stage of ``a`` > 1 ranks that just computed together).
              The ILP carries ``σ`` with two ladders: ``max(σ(g_u), σ(g_v))`` over in-node
              counts, ``max(σ_x(g_u), σ_x(g_v))`` over all, ``σ(g) = α_in + A·s(g)/BW_in``,
              ``σ_x(g) = α_x + A·s(g)/BW_x``; the cheaper one that applies is the term;
              ``ω_w`` rides on the ladder's entry and exit by count.
    OPT_l     = (3 + 2·k_opt) · W_l / BW_mem + n_l · o_tensor
              (the optimizer step reads weights and gradients and writes weights,
               plus k_opt state tensors read and written; BW_mem from the profile;
               n_l the layer's parameter tensors, o_tensor the optimizer's measured
               cost per tensor)
    OPT_call  the optimizer's measured cost per ``step()`` and ``zero_grad()`` call, once per
              iteration (a phase on every rank at its end)
    KFAC_l(g) with ``--optimizer kfac``, for a layer K-FAC preconditions (factors ``a × a`` and
              ``o × o`` over ``L`` positions, :mod:`deeppool.planner.solve.kfac`), added to OPT_l:
                = [h(g)·(ρ·2·s(g)·L·(a² + o²) + n_s·c) + AR(g, 4(a² + o²), 1)] / f   statistics, all-reduce
                  + h(g)·(ρ·E·(a³ + o³) + n_e·c) / (g·i)                             eigendecompositions
                  + ρ·4·a·o·(a + o) + n_p·c + AR(g, 4·a·o, 1)                        preconditioning, broadcast
              with ``ρ`` and ``c`` the layer's own forward on one GPU split into ms per FLOP and a call's
              fixed ms (the line through its profiled times at ``B`` and ``B/4``: K-FAC's matmuls run at
              the layer's matmul rate, and each of its ``n`` tensor calls costs what a call costs there;
              ``c`` is the optimizer's measured cost per tensor where the profile has it),
              ``h(g)`` the profile's core sharing, ``f``/``i`` the factor and inverse intervals,
              ``E`` = EIGH_FLOPS, ``(n_s, n_e, n_p)`` = KFAC_CALLS; the all-reduces only on g > 1. The
              group's ranks gather statistics and eigendecompose at once (``h(g)``); the preconditioning
              runs on the layer's owner while the others wait for its broadcast (no sharing). With
              a profile measured here on a CPU, the three parts' work and calls are instead timed on this
              host by the preconditioner itself on a stand-alone module of the layer's kind and shape
              (:mod:`deeppool.planner.profiling.kfac_times`: the hooks' statistics at ``B``, scaled by
              ``s(g)/B``, plus the factor update; the eigendecompositions; the preconditioning with KL
              clipping and the copy into ``.grad``). The
              inverses are spread over the group's ranks (exact when the group holds a multiple of ``g``
              such layers), so layers with large factors favour large groups.
              Memory adds ``8·(a² + o²)`` (fp32 factors and eigenvectors).
    LOSS(g)   the loss function's forward and backward at the output layer's per-GPU batch
              ``s(g_out)``, measured by the profiler; part of the output layer's phases
    STAGE     on a GPU profile with host times (:attr:`Profile.host`), a stage (consecutive layers on
              the same count) is priced by the stage formula, the host issuing its layers in order
              (the backward in reverse) while the device runs them: layer ``k`` ends on the device at
              ``C_k = max(C_(k-1), H_k) + d_k`` (``H_k`` the host's issue of layers ``1..k``, ``d_k``
              their device time), the stage at ``C_n = max_k (H_k + Σ_(i≥k) d_i)``, and ``fwd_l``,
              ``bwd_l`` of the sum above are the layers' shares ``C_k − C_(k−1)``. The solver prices a
              layer alone at ``max(d_l, h_l)`` (:meth:`CostModel.compute_ms`); plans, the schedule and
              ``T`` use the formula (:meth:`CostModel.stage_phases_ms`). Without host times ``h = 0``
              and both are the profile's times.

Layers run one after another (branches included), each phase on the ranks it
uses: this is the schedule :func:`schedule` lays out, from which GPU-time,
amplification and the idle windows lent to background jobs follow. A layer's
amplification is its GPU-time at ``g`` over its time on one GPU:
``g · (fwd+bwd+BN+AR*+OPT)(g) / (fwd+bwd+OPT)(1)``. Memory on rank 0, which runs every
layer, is ``Σ_l (2 + k_opt) · W_l + A_l · s(g_l)`` (weights, gradients,
optimizer state, stored activations) and must fit the device.

Invariants every prediction keeps (:func:`check_invariants` refuses a plan
that breaks them): every term is finite and ≥ 0, and no layer's GPU-time on
``g`` GPUs is below its time on one (amplification ≥ 1; below 0.5 the figures
are refused as measurement noise, not hardware).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from deeppool.adaptation.kfac_options import KfacOptions
from deeppool.errors import DeeppoolError
from deeppool.model.graph import Layer, LayerGraph
from deeppool.plans import NetworkModel, Optimizer, Precision
from deeppool.planner.profiling.profile import Profile
from deeppool.planner.solve.kfac import EIGH_FLOPS, KFAC_CALLS, FactorSizes, preconditioned_layers

if TYPE_CHECKING:  # timed with torch at plan time; the cost model only reads them
    from deeppool.planner.profiling.kfac_times import KfacTimes

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""The executor's default gradient bucket (``--bucket-mb 25``)."""
_STATS_BYTES = 8
"""Synchronised BatchNorm reduces its statistics in float64."""


class PhaseKind(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    ALLREDUCE = "allreduce"
    RESHARD = "reshard"
    OPTIMIZER = "step"


class SlotKind(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    ALLREDUCE = "allreduce"
    STEP = "step"
    RESHARD_FORWARD = "reshard-forward"
    RESHARD_BACKWARD = "reshard-backward"

    @property
    def phase(self) -> PhaseKind:
        return {SlotKind.FORWARD: PhaseKind.FORWARD, SlotKind.BACKWARD: PhaseKind.BACKWARD,
                SlotKind.ALLREDUCE: PhaseKind.ALLREDUCE, SlotKind.STEP: PhaseKind.OPTIMIZER}.get(self, PhaseKind.RESHARD)


@dataclass(frozen=True)
class ScheduleSlot:
    """One phase of :meth:`CostModel.schedule`, in its order, whatever the plan: a layer's own phase or, with
    ``source``, the reshard of ``source``'s output into ``layer`` (or of its gradient back)."""

    kind: SlotKind
    layer: str
    source: str = ""

    @property
    def reshard(self) -> bool:
        return self.kind in (SlotKind.RESHARD_FORWARD, SlotKind.RESHARD_BACKWARD)

    def ranks(self, counts: Mapping[str, int]) -> int:
        """The ranks it holds under ``counts``: its layer's, and for a reshard the larger of both ends'."""
        own = counts[self.layer]
        return max(own, counts[self.source]) if self.reshard else own


@dataclass(frozen=True, kw_only=True)
class SchedulePhase:
    """One step of an iteration: ``ranks`` 0..ranks-1 are busy from start to end."""

    kind: PhaseKind
    layer: str
    start_ms: float
    end_ms: float
    ranks: int


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Predicts times and memory for a graph, a profile, a network and a global batch."""

    graph: LayerGraph
    profile: Profile
    network: NetworkModel
    global_batch: int
    optimizer: Optimizer = Optimizer.SGD
    precision: Precision = Precision.FP32
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    kfac: KfacOptions = field(default_factory=KfacOptions)
    """K-FAC's update intervals, priced with ``optimizer=Optimizer.KFAC``."""
    kfac_times: Mapping[str, KfacTimes] = field(default_factory=dict)
    """K-FAC's work per layer timed on this host at the global batch on one rank
    (:mod:`deeppool.planner.profiling.kfac_times`); a layer not in it is priced by its FLOPs."""

    def __post_init__(self) -> None:
        if self.bucket_bytes < 0:
            raise DeeppoolError(f"gradient bucket of {self.bucket_bytes} bytes: must be >= 0")

    def per_gpu_batch(self, gpus: int) -> int:
        return math.ceil(self.global_batch / gpus)

    def param_bytes(self, layer: Layer) -> float:
        """``W_l`` in the plan's precision."""
        return layer.param_bytes * self.precision.scale(layer.dtype)

    def act_bytes(self, layer: Layer) -> float:
        """``A_l`` in the plan's precision."""
        return layer.act_bytes * self.precision.scale(layer.dtype)

    @cached_property
    def _tail(self) -> frozenset[str]:
        """The layers in the last gradient bucket: the first ones, whose gradients come last."""
        total = sum(self.param_bytes(layer) for layer in self.graph.layers)
        if self.bucket_bytes == 0 or total == 0:
            return frozenset()
        tail = total % self.bucket_bytes or min(self.bucket_bytes, total)
        names, prefix = [], 0.0
        for layer in self.graph.layers:
            if prefix >= tail:
                break
            names.append(layer.name)
            prefix += self.param_bytes(layer)
        return frozenset(names)

    def compute_ms(self, layer: Layer, gpus: int) -> tuple[float, float]:
        """(fwd_ms, bwd_ms) of ``layer`` on the busiest of ``gpus`` ranks.

        The profile's time at the per-GPU batch ``⌈B/g⌉`` (on ``g > 1``, with BatchNorm synchronised, where the
        profile measured it: :attr:`Profile.grouped`), times ``profile.sharing(g)`` where ranks
        share a host's cores (measured by the profiler, or ``g / concurrent_ranks`` with more ranks than
        cores: the layer's ``g`` ranks compute at once while the others wait for it). With host times, the larger of
        the device's and the host's (``STAGE``)."""
        fwd, bwd = self.profile.times(layer.name, self.per_gpu_batch(gpus), grouped=gpus > 1)
        if self.profile.host:
            host_fwd, host_bwd = self.profile.host_times(layer.name, self.per_gpu_batch(gpus))
            fwd, bwd = max(fwd, host_fwd), max(bwd, host_bwd)
        share = self.profile.sharing(gpus)
        return fwd * share, bwd * share

    def stage_phases_ms(self, assignment: Mapping[str, int]) -> dict[str, tuple[float, float]]:
        """Every layer's (forward, backward) phase under ``assignment``: :meth:`phases_ms` with the compute
        priced by the stage formula (``STAGE``) where the profile has host times."""
        delta = self._stage_delta(assignment)
        found = {}
        for layer in self.graph.layers:
            fwd, bwd = self.phases_ms(layer, assignment[layer.name])
            more = delta.get(layer.name, (0.0, 0.0))
            found[layer.name] = (fwd + more[0], bwd + more[1])
        return found

    def _stage_delta(self, assignment: Mapping[str, int]) -> dict[str, tuple[float, float]]:
        """By layer: its share of its stage by the stage formula less :meth:`compute_ms` (empty without host times)."""
        if not self.profile.host:
            return {}
        stages: list[list[Layer]] = []
        for layer in self.graph.layers:
            if stages and assignment[stages[-1][-1].name] == assignment[layer.name]:
                stages[-1].append(layer)
            else:
                stages.append([layer])
        delta = {}
        for stage in stages:
            g = assignment[stage[0].name]
            fwd = self._flow_shop([self._device_host(layer, g, 0) for layer in stage])
            bwd = self._flow_shop([self._device_host(layer, g, 1) for layer in reversed(stage)])[::-1]
            for layer, f, b in zip(stage, fwd, bwd, strict=True):
                priced = self.compute_ms(layer, g)
                delta[layer.name] = (f - priced[0], b - priced[1])
        return delta

    def _device_host(self, layer: Layer, gpus: int, index: int) -> tuple[float, float]:
        """(device, host) ms of ``layer``'s forward (``index`` 0) or backward (1) on ``gpus`` ranks."""
        batch, share = self.per_gpu_batch(gpus), self.profile.sharing(gpus)
        device = self.profile.times(layer.name, batch, grouped=gpus > 1)[index]
        return device * share, self.profile.host_times(layer.name, batch)[index] * share

    @staticmethod
    def _flow_shop(layers: list[tuple[float, float]]) -> list[float]:
        """Each layer's share ``C_k − C_(k−1)`` of a stage's time, its (device, host) ms in issue order."""
        issued = done = 0.0
        shares = []
        for device, host in layers:
            issued += host
            end = max(done, issued) + device
            shares.append(end - done)
            done = end
        return shares

    def allreduce_ms(self, layer: Layer, gpus: int) -> float:
        """``AR*_l(g)``: the gradient all-reduce time the layer does not hide behind the backward."""
        nbytes = self.param_bytes(layer)
        if gpus == 1 or nbytes == 0:
            return 0.0
        if self.bucket_bytes == 0:
            return 1e3 * self.network.allreduce_s(gpus, nbytes) + self.bucket_copy_ms(layer)
        full = 1e3 * self.network.allreduce_s(gpus, nbytes, latencies=0.0) + self.bucket_copy_ms(layer)
        if layer.name in self._tail:
            return full
        return max(0.0, full - self.network.allreduce_overlap * self.compute_ms(layer, gpus)[1])

    def round_ms(self, gpus: int) -> float:
        """``L(g)``: one bucketed all-reduce's latency on ``gpus`` ranks (0 on one rank or unbucketed)."""
        if self.bucket_bytes == 0 or gpus == 1:
            return 0.0
        return 1e3 * self.network.allreduce_s(gpus, 0.0)

    def rounds_ms(self, gpus: int, group_bytes: float) -> float:
        """``ROUNDS(g)``: the latency rounds of the all-reduces of a rank group holding ``group_bytes``."""
        if group_bytes <= 0:
            return 0.0
        rounds = max(1.0, (1 - self.network.allreduce_overlap) * group_bytes / max(self.bucket_bytes, 1))
        return rounds * self.round_ms(gpus)

    def group_rounds_ms(self, assignment: Mapping[str, int]) -> dict[str, float]:
        """``ROUNDS(g) + SKEW(g)`` of every rank group, by the group's first layer with parameters (else its
        first layer)."""
        groups: dict[int, list[Layer]] = {}
        for layer in self.graph.layers:
            groups.setdefault(assignment[layer.name], []).append(layer)
        found = {}
        for g, members in groups.items():
            holders = [m for m in members if self.param_bytes(m) > 0]
            rounds = self.rounds_ms(g, sum(self.param_bytes(m) for m in holders))
            skewed = self.network.skew_per_s(g) > 0  # the compute is summed only where it is charged
            compute = sum(sum(self.compute_ms(m, g)) for m in members) if skewed else 0.0
            found[(holders or members)[0].name] = rounds + self.skew_ms(g, compute)
        return {name: ms for name, ms in found.items() if ms > 0}

    def skew_ms(self, gpus: int, compute_ms: float) -> float:
        """``SKEW(g)``: what a group of ``gpus`` ranks that computed ``compute_ms`` waits at its collective
        beyond the network's figures."""
        slope = self.network.skew_per_s(gpus)
        return slope * max(0.0, compute_ms - 1e3 * self.network.skew_after_s) if slope > 0 else 0.0

    def bucket_copy_ms(self, layer: Layer) -> float:
        """``CP_l = 4·W_l/BW_mem``: the layer's gradients copied into the flat bucket and the sums back."""
        if self.bucket_bytes == 0 and len(layer.params) <= 1:
            return 0.0
        return 1e3 * 4 * self.param_bytes(layer) / self.profile.memory_bandwidth

    def batchnorm_ms(self, layer: Layer, gpus: int) -> tuple[float, float]:
        """``BN_l(g)`` split into (forward, backward): synchronised BatchNorm's statistics all-reduces."""
        if gpus == 1 or "BatchNorm" not in layer.op:
            return 0.0, 0.0
        channels = layer.output_shape[0] if layer.output_shape else 1
        forward = sum(self.network.allreduce_s(gpus, _STATS_BYTES * n) for n in (channels + 1, channels))
        return 1e3 * forward, 1e3 * self.network.allreduce_s(gpus, _STATS_BYTES * 2 * channels)

    def phases_ms(self, layer: Layer, gpus: int) -> tuple[float, float]:
        """(forward, backward) ms the layer holds its ranks: compute plus synchronised BatchNorm, and
        for the output layer the loss."""
        fwd, bwd = self.compute_ms(layer, gpus)
        bn_fwd, bn_bwd = self.batchnorm_ms(layer, gpus)
        loss_fwd, loss_bwd = self.loss_ms(layer, gpus)
        return fwd + bn_fwd + loss_fwd, bwd + bn_bwd + loss_bwd

    def loss_ms(self, layer: Layer, gpus: int) -> tuple[float, float]:
        """``LOSS(g)`` as (forward, backward) for the output layer, (0, 0) for the others."""
        if layer.name != self.graph.output:
            return 0.0, 0.0
        fwd, bwd = self.profile.loss_times(self.per_gpu_batch(gpus))
        share = self.profile.sharing(gpus)
        return fwd * share, bwd * share

    def step_ms(self, layer: Layer) -> float:
        """The optimizer step over the layer's parameters (the same on each of its ranks)."""
        moved = self.optimizer.step_traffic(self.param_bytes(layer))
        overhead = self.profile.overhead(self.optimizer.base.value)
        return (1e3 * moved / self.profile.memory_bandwidth + overhead.per_tensor_ms * len(layer.params)
                + overhead.per_megabyte_ms * self.param_bytes(layer) / 1e6)

    @property
    def step_call_ms(self) -> float:
        """``OPT_call``: the optimizer's per-call cost, paid once per iteration."""
        return self.profile.overhead(self.optimizer.base.value).call_ms

    @cached_property
    def preconditioned(self) -> dict[str, FactorSizes]:
        """The layers K-FAC preconditions and their factor sizes (none unless ``optimizer`` is K-FAC)."""
        return preconditioned_layers(self.graph) if self.optimizer is Optimizer.KFAC else {}

    def kfac_ms(self, layer: Layer, gpus: int) -> float:
        """``KFAC_l(g)``: K-FAC's statistics, eigendecompositions and preconditioning, amortised per step."""
        sizes = self.preconditioned.get(layer.name)
        if sizes is None or layer.fwd_flops <= 0:
            return 0.0
        rate, call = self._matmul_rate(layer)
        share = self.profile.sharing(gpus)
        a, o, s = sizes.inputs, sizes.outputs, self.per_gpu_batch(gpus)
        squares = a * a + o * o
        timed = self.kfac_times.get(layer.name)
        work = (rate * 2 * s * sizes.positions * squares + KFAC_CALLS[0] * call,
                rate * EIGH_FLOPS * (a ** 3 + o ** 3) + KFAC_CALLS[1] * call,
                rate * 4 * a * o * (a + o) + KFAC_CALLS[2] * call) if timed is None else (
            timed.statistics_ms * s / self.global_batch + timed.factor_update_ms, timed.inverses_ms,
            timed.precondition_ms)
        statistics, inverses, precondition = share * work[0], share * work[1] / gpus, work[2]
        if gpus > 1:
            statistics += 1e3 * self.network.allreduce_s(gpus, 4 * squares)
            precondition += 1e3 * self.network.allreduce_s(gpus, 4 * a * o)
        return (statistics / self.kfac.factor_update_steps + inverses / self.kfac.inv_update_steps
                + precondition)

    def _matmul_rate(self, layer: Layer) -> tuple[float, float]:
        """``ρ`` (ms per FLOP) and ``c`` (ms per tensor call): the line through the layer's forward times at the
        global batch and a quarter of it gives the rate per sample and a call's fixed cost; where the profile
        measured the optimizer's cost per tensor (a handful of small calls, on this host), that is ``c``."""
        high, low = self.global_batch, max(1, self.global_batch // 4)
        at_high, at_low = (self.profile.times(layer.name, batch)[0] for batch in (high, low))
        per_sample = (at_high - at_low) / (high - low) if high > low else at_high / high
        per_sample = max(per_sample, 0.1 * at_high / high)
        measured = self.profile.overhead(Optimizer.SGD.value).per_tensor_ms
        return per_sample / layer.fwd_flops, measured if measured > 0 else max(0.0, at_high - per_sample * high)

    @cached_property
    def _layer_memo(self) -> dict[tuple[str, int], float]:
        """``layer_ms`` by (layer, GPUs): the ILP, the baselines and the plan ask for the same ones often."""
        return {}

    def layer_ms(self, layer: Layer, gpus: int) -> float:
        """Compute, synchronised BatchNorm, exposed all-reduce and optimizer step: the time ``layer`` holds its GPUs."""
        key = (layer.name, gpus)
        if key not in self._layer_memo:
            fwd, bwd = self.phases_ms(layer, gpus)
            self._layer_memo[key] = (fwd + bwd + self.allreduce_ms(layer, gpus) + self.step_ms(layer)
                                     + self.kfac_ms(layer, gpus))
        return self._layer_memo[key]

    def reshard_side_ms(self, producer: Layer, gpus: int, *, across: bool = False) -> float:
        """``σ(g)`` (in-node) or, with ``across``, ``σ_x(g)``: one shard of ``gpus`` ranks over one link."""
        bandwidth = self.network.inter_bandwidth if across else self.network.intra_bandwidth
        latency = self.network.inter_latency_s if across else self.network.intra_latency_s
        moved = self.act_bytes(producer) * self.per_gpu_batch(gpus)
        return 1e3 * (latency + moved / bandwidth)

    def sync_ms(self, gpus: int) -> float:
        """``ω_w(g)·[g > 1]``: handing data on from a stage whose ``gpus`` ranks just computed together."""
        return 1e3 * self.network.sync_latency_s(gpus)

    def crosses(self, src_gpus: int, dst_gpus: int) -> bool:
        return max(src_gpus, dst_gpus) > self.network.gpus_per_node

    def reshard_ms(self, producer: Layer, src_gpus: int, dst_gpus: int) -> float:
        """``R_u(src → dst)``: one direction of moving ``producer``'s output (or its gradient) between GPU counts."""
        if src_gpus == dst_gpus:
            return 0.0
        smaller = min(src_gpus, dst_gpus)
        side = self.reshard_side_ms(producer, smaller, across=self.crosses(src_gpus, dst_gpus))
        return side + self.sync_ms(src_gpus)

    def round_trip_ms(self, producer: Layer, producer_gpus: int, consumer_gpus: int) -> float:
        """Both directions of an edge: activations forward, their gradients back."""
        return (self.reshard_ms(producer, producer_gpus, consumer_gpus)
                + self.reshard_ms(producer, consumer_gpus, producer_gpus))

    def amplification(self, layer: Layer, gpus: int) -> float:
        single = self.layer_ms(layer, 1)
        if single <= 0:
            return 1.0
        return gpus * self.layer_ms(layer, gpus) / single

    def memory_bytes(self, layer: Layer, gpus: int) -> int:
        """Bytes ``layer`` needs on each of its ranks (rank 0 runs every layer)."""
        state = (2 + self.optimizer.state_factor) * self.param_bytes(layer)
        sizes = self.preconditioned.get(layer.name)
        factors = 0 if sizes is None else 8 * (sizes.inputs ** 2 + sizes.outputs ** 2)
        return int(state + factors + self.act_bytes(layer) * self.per_gpu_batch(gpus))

    def iteration_ms(self, assignment: Mapping[str, int]) -> float:
        """The predicted iteration time T of the formula above."""
        compute = sum(self.layer_ms(layer, assignment[layer.name]) for layer in self.graph.layers)
        compute += sum(f + b for f, b in self._stage_delta(assignment).values())
        moves = sum(
            self.round_trip_ms(self.graph.layer(src), assignment[src], assignment[dst])
            for src, dst in self.graph.edges()
        )
        return compute + moves + sum(self.group_rounds_ms(assignment).values()) + self.step_call_ms

    def gpu_seconds(self, assignment: Mapping[str, int]) -> float:
        """GPU-seconds of one iteration: every phase's duration times the ranks it holds."""
        return sum((p.end_ms - p.start_ms) * p.ranks for p in self.schedule(assignment)) / 1e3

    def peak_memory_bytes(self, assignment: Mapping[str, int]) -> int:
        return sum(self.memory_bytes(layer, assignment[layer.name]) for layer in self.graph.layers)

    def slots(self) -> list[ScheduleSlot]:
        """Every phase :meth:`schedule` may hold, in its order: forward in order (each layer after the reshards
        into it), backward in reverse (each layer's all-reduce, then its gradients' reshards back), the
        layers' optimizer steps; the step's per-call phase, last, aside."""
        layers = self.graph.layers
        names = {layer.name for layer in layers}
        found: list[ScheduleSlot] = []
        for layer in layers:
            found += [ScheduleSlot(SlotKind.RESHARD_FORWARD, layer.name, src) for src in dict.fromkeys(layer.inputs)
                      if src in names]
            found.append(ScheduleSlot(SlotKind.FORWARD, layer.name))
        for layer in reversed(layers):
            found += [ScheduleSlot(SlotKind.BACKWARD, layer.name), ScheduleSlot(SlotKind.ALLREDUCE, layer.name)]
            found += [ScheduleSlot(SlotKind.RESHARD_BACKWARD, layer.name, src) for src in dict.fromkeys(layer.inputs)
                      if src in names]
        return found + [ScheduleSlot(SlotKind.STEP, layer.name) for layer in layers]

    def slot_ms(self, slot: ScheduleSlot, counts: Mapping[str, int]) -> float:
        """The slot's duration under ``counts`` (its layer's count, and its source's for a reshard), without the
        all-reduce rounds :meth:`schedule` adds to a group's first all-reduce."""
        layer, g = self.graph.layer(slot.layer), counts[slot.layer]
        if slot.kind is SlotKind.FORWARD:
            return self.phases_ms(layer, g)[0]
        if slot.kind is SlotKind.BACKWARD:
            return self.phases_ms(layer, g)[1]
        if slot.kind is SlotKind.ALLREDUCE:
            return self.allreduce_ms(layer, g)
        if slot.kind is SlotKind.STEP:
            return self.step_ms(layer) + self.kfac_ms(layer, g)
        source = counts[slot.source]
        ends = (source, g) if slot.kind is SlotKind.RESHARD_FORWARD else (g, source)
        return self.reshard_ms(self.graph.layer(slot.source), *ends)

    def schedule(self, assignment: Mapping[str, int]) -> list[SchedulePhase]:
        """The phases of one iteration (:meth:`slots` that take time), then the optimizer's per-call step."""
        rounds = self.group_rounds_ms(assignment)
        delta = self._stage_delta(assignment)
        phases: list[SchedulePhase] = []
        clock = 0.0
        for slot in self.slots():
            duration = self.slot_ms(slot, assignment)
            if slot.kind in (SlotKind.FORWARD, SlotKind.BACKWARD) and slot.layer in delta:
                duration += delta[slot.layer][slot.kind is SlotKind.BACKWARD]
            if slot.kind is SlotKind.ALLREDUCE:
                duration += rounds.get(slot.layer, 0.0)
            if duration > 0:
                phases.append(SchedulePhase(kind=slot.kind.phase, layer=slot.layer, start_ms=clock,
                                            end_ms=clock + duration, ranks=slot.ranks(assignment)))
                clock += duration
        if self.step_call_ms > 0:
            phases.append(SchedulePhase(kind=PhaseKind.OPTIMIZER, layer="", start_ms=clock,
                                        end_ms=clock + self.step_call_ms, ranks=max(assignment.values(), default=1)))
        return phases


def check_invariants(cost: CostModel, assignment: Mapping[str, int], *, tolerance: float = 0.5) -> None:
    """Refuse figures that break the cost model's own invariants, naming the layer.

    Every term must be finite and >= 0, and a layer's GPU-time on g GPUs may
    not fall below ``tolerance`` times its time on one GPU: a profile that says
    so was measured through noise (or interpolated from an outlier).
    """
    for layer in cost.graph.layers:
        g = assignment[layer.name]
        terms = (*cost.compute_ms(layer, g), cost.allreduce_ms(layer, g), cost.step_ms(layer))
        if not all(math.isfinite(t) and t >= 0 for t in terms):
            raise DeeppoolError(f"layer '{layer.name}' on {g} GPUs has times {terms}: the profile is corrupt")
        amplification = cost.amplification(layer, g)
        if amplification < tolerance:
            raise DeeppoolError(
                f"layer '{layer.name}' on {g} GPUs would use {amplification:.2f}x its one-GPU GPU-time, "
                "which cannot be: its measured times are noise; re-profile with more repeats "
                "(or an idle machine)"
            )
