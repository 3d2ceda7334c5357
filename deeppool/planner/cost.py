"""The one cost model of deeppool: planner, baselines, simulator and reports import it.

A plan gives every layer ``l`` a GPU count ``g_l``; the layer runs on ranks
``0..g_l-1`` and rank ``i`` holds samples ``[⌊i·B/g⌋, ⌊(i+1)·B/g⌋)`` of the
global batch ``B`` (uneven splits allowed), so the per-GPU batch is
``s(g) = ⌈B/g⌉``. With per-sample activation bytes ``A_l``, parameter bytes
``W_l``, per-GPU bandwidth ``BW(g)`` and latency ``α(g)`` (node-local when
``g`` ranks fit in a node, else cross-node) the predicted iteration time is

    T = Σ_l [ fwd_l(s(g_l)) + bwd_l(s(g_l)) + AR_l(g_l) + OPT_l ] + Σ_(u→v) 2 · R_uv(g_u, g_v)

    AR_l(g)        = 0 if g = 1 or W_l = 0, else 2·(g−1)/g · W_l / (η·BW(g)) + 2⌈log₂ g⌉·λ·α(g)
                     (all-reduce of the layer's gradients inside its group: the ring's
                      bandwidth term, the tree's latency term, as NCCL picks per size;
                      η and λ scale the network's figures for all-reduce, 1 for the
                      presets, measured by ``deeppool profile-network``)
    R_uv(g_u, g_v) = 0 if g_u = g_v, else max(side(g_u), side(g_v)),
    side(g)        = α(g) + A_u · s(g) / BW(g)
                     (activations resharded forward, their gradients backward; the
                      busiest rank sends or receives at most one shard of either side)

    OPT_l          = (3 + 2·k_opt) · W_l / BW_mem
                     (the optimizer step reads weights and gradients and writes weights,
                      plus k_opt state tensors read and written; BW_mem from the profile)

Layers run one after another (branches included), each phase on the ranks it
uses: this is the schedule :func:`schedule` lays out, from which GPU-time,
amplification and the idle windows lent to background jobs follow. A layer's
amplification is its GPU-time at ``g`` over its time on one GPU:
``g · (fwd+bwd+AR+OPT)(g) / (fwd+bwd+OPT)(1)``. Memory on rank 0, which runs every
layer, is ``Σ_l (2 + k_opt) · W_l + A_l · s(g_l)`` (weights, gradients,
optimizer state, stored activations) and must fit the device.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass

from deeppool.planner.graph import Layer, LayerGraph
from deeppool.planner.hardware import NetworkModel
from deeppool.planner.profile import Profile

class Optimizer(enum.Enum):
    """The optimizer the plan is for: it sets optimizer state memory and step time."""

    SGD = "sgd"
    ADAM = "adam"

    @property
    def state_factor(self) -> int:
        """Optimizer state bytes per parameter byte (SGD without momentum: none; Adam: two moments)."""
        return {Optimizer.SGD: 0, Optimizer.ADAM: 2}[self]


class PhaseKind(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    ALLREDUCE = "allreduce"
    RESHARD = "reshard"
    OPTIMIZER = "step"


@dataclass(frozen=True, kw_only=True)
class Phase:
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

    def per_gpu_batch(self, gpus: int) -> int:
        return math.ceil(self.global_batch / gpus)

    def compute_ms(self, layer: Layer, gpus: int) -> tuple[float, float]:
        """(fwd_ms, bwd_ms) of ``layer`` on the busiest of ``gpus`` ranks."""
        return self.profile.times(layer.name, self.per_gpu_batch(gpus))

    def allreduce_ms(self, layer: Layer, gpus: int) -> float:
        if gpus == 1 or layer.param_bytes == 0:
            return 0.0
        seconds = 2 * (gpus - 1) / gpus * layer.param_bytes / self.network.allreduce_bandwidth(gpus)
        return 1e3 * (seconds + 2 * math.ceil(math.log2(gpus)) * self.network.allreduce_latency_s(gpus))

    def step_ms(self, layer: Layer) -> float:
        """The optimizer step over the layer's parameters (the same on each of its ranks)."""
        moved = (3 + 2 * self.optimizer.state_factor) * layer.param_bytes
        return 1e3 * moved / self.profile.memory_bandwidth

    def layer_ms(self, layer: Layer, gpus: int) -> float:
        """Compute, gradient all-reduce and optimizer step: the time ``layer`` holds its GPUs."""
        fwd, bwd = self.compute_ms(layer, gpus)
        return fwd + bwd + self.allreduce_ms(layer, gpus) + self.step_ms(layer)

    def reshard_side_ms(self, producer: Layer, gpus: int) -> float:
        seconds = producer.act_bytes * self.per_gpu_batch(gpus) / self.network.bandwidth(gpus)
        return 1e3 * (seconds + self.network.latency_s(gpus))

    def reshard_ms(self, producer: Layer, src_gpus: int, dst_gpus: int) -> float:
        """One direction of moving ``producer``'s output between GPU counts."""
        if src_gpus == dst_gpus:
            return 0.0
        return max(self.reshard_side_ms(producer, src_gpus), self.reshard_side_ms(producer, dst_gpus))

    def amplification(self, layer: Layer, gpus: int) -> float:
        single = self.layer_ms(layer, 1)
        if single <= 0:
            return 1.0
        return gpus * self.layer_ms(layer, gpus) / single

    def memory_bytes(self, layer: Layer, gpus: int) -> int:
        """Bytes ``layer`` needs on each of its ranks (rank 0 runs every layer)."""
        state = (2 + self.optimizer.state_factor) * layer.param_bytes
        return state + layer.act_bytes * self.per_gpu_batch(gpus)

    def iteration_ms(self, assignment: Mapping[str, int]) -> float:
        """The predicted iteration time T of the formula above."""
        compute = sum(self.layer_ms(layer, assignment[layer.name]) for layer in self.graph.layers)
        moves = sum(
            2 * self.reshard_ms(self.graph.layer(src), assignment[src], assignment[dst])
            for src, dst in self.graph.edges()
        )
        return compute + moves

    def peak_memory_bytes(self, assignment: Mapping[str, int]) -> int:
        return sum(self.memory_bytes(layer, assignment[layer.name]) for layer in self.graph.layers)

    def schedule(self, assignment: Mapping[str, int]) -> list[Phase]:
        """The phases of one iteration: forward in order, backward in reverse, optimizer steps."""
        phases: list[Phase] = []
        clock = 0.0

        def add(kind: PhaseKind, layer: str, duration: float, ranks: int) -> None:
            nonlocal clock
            if duration > 0:
                phases.append(Phase(kind=kind, layer=layer, start_ms=clock, end_ms=clock + duration, ranks=ranks))
                clock += duration

        producers = {layer.name: layer for layer in self.graph.layers}
        for layer in self.graph.layers:
            g = assignment[layer.name]
            for src in dict.fromkeys(layer.inputs):
                if src in producers:
                    move = self.reshard_ms(producers[src], assignment[src], g)
                    add(PhaseKind.RESHARD, layer.name, move, max(assignment[src], g))
            add(PhaseKind.FORWARD, layer.name, self.compute_ms(layer, g)[0], g)
        for layer in reversed(self.graph.layers):
            g = assignment[layer.name]
            add(PhaseKind.BACKWARD, layer.name, self.compute_ms(layer, g)[1], g)
            add(PhaseKind.ALLREDUCE, layer.name, self.allreduce_ms(layer, g), g)
            for src in dict.fromkeys(layer.inputs):
                if src in producers:
                    move = self.reshard_ms(producers[src], assignment[src], g)
                    add(PhaseKind.RESHARD, layer.name, move, max(assignment[src], g))
        for layer in self.graph.layers:
            add(PhaseKind.OPTIMIZER, layer.name, self.step_ms(layer), assignment[layer.name])
        return phases
