"""A rank's program: the ordered operations of one training iteration.

Every rank derives, from the Plan and the traced LayerGraph alone, the same
global sequence of operations and keeps the ones it takes part in. The order is
the cost model's schedule (:meth:`deeppool.planner.cost.CostModel.schedule`):
forward over the layers in topological order (reshard each producer's output
in, then compute), the loss on the output layer, then backward in reverse
(compute, all-reduce the layer's gradients, send the input gradients back to
the producers' ranks), then the optimizer step of every layer on its ranks
(one phase per layer, as in the schedule; the engine steps its optimizer once,
at the rank's last step op). Because all ranks walk one
global order and every communication joins only ranks that walk it too, no
rank can wait on a peer that waits on it.

An :class:`Op` that corresponds to a phase of the plan's schedule carries that
phase's index; idle windows (``plan.predicted.idle_windows``) are tied to the
phase after which they begin (see :mod:`deeppool.executor.idle`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from deeppool.errors import DeeppoolError
from deeppool.planner.graph import Layer, LayerGraph
from deeppool.planner.plan import IdleWindow, Plan, PlannedLayer


class OpKind(enum.Enum):
    RESHARD = "reshard"
    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"
    ALLREDUCE = "allreduce"
    RESHARD_GRAD = "reshard_grad"
    STEP = "step"

    @property
    def phase_kind(self) -> str:
        """The plan's name for the phase: both reshard directions are ``reshard``."""
        return "reshard" if self is OpKind.RESHARD_GRAD else self.value


@dataclass(frozen=True, kw_only=True)
class Transfer:
    """Samples ``[start, end)`` of a producer's output held by ``src``, needed by ``dst``."""

    src: int
    dst: int
    start: int
    end: int


@dataclass(frozen=True, kw_only=True)
class Op:
    """One operation; ``layer`` is the consumer for reshards, ``producer`` its input."""

    kind: OpKind
    layer: str
    producer: str | None = None
    transfers: tuple[Transfer, ...] = ()
    phase: int | None = None

    @property
    def label(self) -> str:
        """The plan's phase label, e.g. ``forward:conv1`` (as in ``IdleWindow.after``)."""
        return f"{self.kind.phase_kind}:{self.layer}"


@dataclass(frozen=True, kw_only=True)
class Phase:
    """A phase of the plan's schedule, by structure: its label and how many ranks it uses."""

    label: str
    ranks: int


@dataclass(frozen=True, kw_only=True)
class Program:
    """The ops of one iteration for ``rank``, and the global phase sequence."""

    rank: int
    ops: tuple[Op, ...]
    phases: tuple[Phase, ...]


def transfers(
    src: tuple[tuple[int, int], ...], dst: tuple[tuple[int, int], ...]
) -> tuple[Transfer, ...]:
    """Overlaps of the source ranks' sample ranges with the destination ranks'."""
    moves = []
    for dst_rank, (dst_start, dst_end) in enumerate(dst):
        for src_rank, (src_start, src_end) in enumerate(src):
            start, end = max(src_start, dst_start), min(src_end, dst_end)
            if start < end:
                moves.append(Transfer(src=src_rank, dst=dst_rank, start=start, end=end))
    return tuple(moves)


def grad_flows(graph: LayerGraph) -> dict[str, bool]:
    """Whether a gradient reaches each layer's output (float output fed by parameters)."""
    flows: dict[str, bool] = {}
    for layer in graph.layers:
        floating = layer.dtype.startswith(("float", "bfloat", "complex"))
        flows[layer.name] = floating and (
            bool(layer.params) or any(flows.get(src, False) for src in layer.inputs)
        )
    return flows


def build_program(plan: Plan, graph: LayerGraph, rank: int) -> Program:
    """Rank ``rank``'s ops in the global order, each plan phase numbered."""
    builder = _Builder(plan, graph, rank)
    builder.forward()
    builder.backward()
    builder.steps()
    return Program(rank=rank, ops=tuple(builder.ops), phases=tuple(builder.phases))


class _Builder:
    def __init__(self, plan: Plan, graph: LayerGraph, rank: int) -> None:
        self.planned = {layer.name: layer for layer in plan.layers}
        self.graph = graph
        self.rank = rank
        self.flows = grad_flows(graph)
        self.ops: list[Op] = []
        self.phases: list[Phase] = []

    def emit(self, op: Op, *, ranks: int, phase: bool = False) -> None:
        index = None
        if phase:
            index = len(self.phases)
            self.phases.append(Phase(label=op.label, ranks=ranks))
        if self.rank < ranks:
            self.ops.append(Op(**{**op.__dict__, "phase": index}))

    def _producers(self, layer: Layer) -> list[PlannedLayer]:
        return [self.planned[src] for src in dict.fromkeys(layer.inputs) if src in self.planned]

    def forward(self) -> None:
        for layer in self.graph.layers:
            planned = self.planned[layer.name]
            for producer in self._producers(layer):
                moves = transfers(producer.samples, planned.samples)
                op = Op(kind=OpKind.RESHARD, layer=layer.name, producer=producer.name, transfers=moves)
                self.emit(op, ranks=max(producer.gpus, planned.gpus), phase=producer.gpus != planned.gpus)
            forward = Op(kind=OpKind.FORWARD, layer=layer.name)
            self.emit(forward, ranks=planned.gpus, phase=planned.fwd_ms > 0)
            if layer.name == self.graph.output:
                self.emit(Op(kind=OpKind.LOSS, layer=layer.name), ranks=planned.gpus)

    def backward(self) -> None:
        for layer in reversed(self.graph.layers):
            planned = self.planned[layer.name]
            self.emit(Op(kind=OpKind.BACKWARD, layer=layer.name), ranks=planned.gpus, phase=planned.bwd_ms > 0)
            self.emit(
                Op(kind=OpKind.ALLREDUCE, layer=layer.name), ranks=planned.gpus, phase=planned.allreduce_ms > 0
            )
            for producer in self._producers(layer):
                moves = transfers(producer.samples, planned.samples) if self.flows[producer.name] else ()
                op = Op(kind=OpKind.RESHARD_GRAD, layer=layer.name, producer=producer.name, transfers=moves)
                self.emit(op, ranks=max(producer.gpus, planned.gpus), phase=producer.gpus != planned.gpus)


    def steps(self) -> None:
        """One optimizer-step phase per layer on its ranks (the engine steps once, at the last)."""
        for layer in self.graph.layers:
            planned = self.planned[layer.name]
            self.emit(Op(kind=OpKind.STEP, layer=layer.name), ranks=planned.gpus, phase=planned.step_ms > 0)


def idle_positions(program: Program, windows: list[IdleWindow]) -> dict[int | None, IdleWindow]:
    """Tie each of the rank's idle windows to the phase index after which it begins.

    Reconstructs the windows the way :func:`deeppool.planner.plan.idle_windows`
    derives them (a gap wherever a phase runs without this rank) and matches
    them, in order, with the plan's; key ``None`` is a window at iteration start.
    """
    expected: list[tuple[int | None, str | None]] = []
    last: int | None = None
    gap = False
    for index, phase in enumerate(program.phases):
        if phase.ranks <= program.rank:
            gap = True
            continue
        if gap:
            expected.append((last, None if last is None else program.phases[last].label))
        last, gap = index, False
    if gap:
        expected.append((last, None if last is None else program.phases[last].label))
    ordered = sorted(windows, key=lambda w: w.start_ms)
    if [label for _, label in expected] != [w.after for w in ordered]:
        raise DeeppoolError(
            f"rank {program.rank}: the plan's idle windows do not follow from its layers "
            f"(expected after {[label for _, label in expected]}, plan says {[w.after for w in ordered]}): "
            "regenerate the plan"
        )
    return {position: window for (position, _), window in zip(expected, ordered, strict=True)}


def rank_groups(plan: Plan) -> list[tuple[int, ...]]:
    """The distinct rank sets of more than one rank that layers run on, smallest first."""
    return [tuple(range(g)) for g in sorted({layer.gpus for layer in plan.layers}) if g > 1]
