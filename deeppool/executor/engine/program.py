"""A rank's program: the ordered operations of one training iteration, by stage.

Consecutive layers that run on the same ranks with the same sample split form
one :class:`Stage` (as in ``torch.distributed.pipelining`` and DeepPool's
runtime): one forward, one backward, one gradient hand-over to the all-reduce
and one optimizer-step op per stage. A layer starts a new stage when its
split differs from the previous layer's or when one of its producers has a
different split, so reshards that move samples between ranks sit only at
stage boundaries, in front of the stage's first layer.

Every rank derives, from the Plan and the traced LayerGraph alone, the same
global sequence of operations and keeps the ones it takes part in. The order is
the cost model's schedule (:meth:`deeppool.planner.solve.cost.CostModel.schedule`)
with each stage's layers fused: forward over the stages in topological order
(reshard each outside producer's output in, then compute), the loss on the
output layer's stage, then backward in reverse (compute, hand the stage's
gradients to the all-reduce, send the input gradients back to the producers'
ranks), then the optimizer step (the engine steps its optimizer once, at the
rank's last step op). Because all ranks walk one global order and every
communication joins only ranks that walk it too, no rank can wait on a peer
that waits on it.

The plan's schedule has one phase per layer and kind (``forward:conv1``...);
:attr:`Program.phases` lists them all in order, and an :class:`Op` carries the
indices of the phases it covers. Idle windows (``plan.predicted.idle_windows``)
are tied to the phase after which they begin (see
:mod:`deeppool.executor.engine.idle`); a rank's participation changes only between
stages, so a window always begins after the last phase an op covers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from deeppool.errors import DeeppoolError
from deeppool.model.graph import LayerGraph, grad_flows
from deeppool.plans import IdleWindow, Plan, PlannedLayer


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
class Stage:
    """Consecutive layers on ranks ``0..gpus-1`` with one sample split, run as one unit."""

    index: int
    layers: tuple[str, ...]
    gpus: int

    @property
    def name(self) -> str:
        """``conv1`` for one layer, ``conv1..fc`` for several."""
        return self.layers[0] if len(self.layers) == 1 else f"{self.layers[0]}..{self.layers[-1]}"


@dataclass(frozen=True, kw_only=True)
class Op:
    """One operation of a stage: ``layer`` is the consuming layer of a reshard, else the stage's name."""

    kind: OpKind
    layer: str
    stage: int
    producer: str | None = None
    transfers: tuple[Transfer, ...] = ()
    phases: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        """The span label, e.g. ``forward:conv1..fc`` or ``reshard:fc``."""
        return f"{self.kind.phase_kind}:{self.layer}"


@dataclass(frozen=True, kw_only=True)
class ProgramPhase:
    """A phase of the plan's schedule, by structure: its label and how many ranks it uses."""

    label: str
    ranks: int


@dataclass(frozen=True, kw_only=True)
class Program:
    """The ops of one iteration for ``rank``, the stages, and the global phase sequence."""

    rank: int
    ops: tuple[Op, ...]
    stages: tuple[Stage, ...]
    phases: tuple[ProgramPhase, ...]


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


def partition(plan: Plan, graph: LayerGraph) -> tuple[Stage, ...]:
    """Split the layers, in topological order, into stages (see the module docstring)."""
    planned = {layer.name: layer for layer in plan.layers}
    groups: list[list[str]] = []
    for layer in graph.layers:
        split = planned[layer.name].samples
        producers = [planned[src].samples for src in layer.inputs if src in planned]
        joins = bool(groups) and planned[groups[-1][-1]].samples == split and all(p == split for p in producers)
        if joins:
            groups[-1].append(layer.name)
        else:
            groups.append([layer.name])
    return tuple(
        Stage(index=index, layers=tuple(names), gpus=planned[names[0]].gpus) for index, names in enumerate(groups)
    )


def build_program(plan: Plan, graph: LayerGraph, rank: int) -> Program:
    """Rank ``rank``'s ops in the global order, each plan phase numbered."""
    builder = _Builder(plan, graph, rank)
    builder.forward()
    builder.backward()
    builder.steps()
    return Program(rank=rank, ops=tuple(builder.ops), stages=builder.stages, phases=tuple(builder.phases))


class _Builder:
    def __init__(self, plan: Plan, graph: LayerGraph, rank: int) -> None:
        self.planned = {layer.name: layer for layer in plan.layers}
        self.layers = {layer.name: layer for layer in graph.layers}
        self.graph = graph
        self.rank = rank
        self.flows = grad_flows(graph)
        self.stages = partition(plan, graph)
        self.ops: list[Op] = []
        self.phases: list[ProgramPhase] = []

    def phase(self, label: str, ranks: int, when: bool) -> tuple[int, ...]:
        if not when:
            return ()
        self.phases.append(ProgramPhase(label=label, ranks=ranks))
        return (len(self.phases) - 1,)

    def emit(self, op: Op, *, ranks: int) -> None:
        if self.rank < ranks:
            self.ops.append(op)

    def outside(self, stage: Stage) -> list[tuple[str, PlannedLayer]]:
        """(first consuming layer, producer) for each producer outside the stage, in consumption order."""
        inside = set(stage.layers)
        found: dict[str, tuple[str, PlannedLayer]] = {}
        for name in stage.layers:
            for src in self.layers[name].inputs:
                if src in self.planned and src not in inside and src not in found:
                    found[src] = (name, self.planned[src])
        return list(found.values())

    def backward_order(self, stage: Stage) -> list[tuple[str, PlannedLayer]]:
        """The outside producers by consuming layer in reverse, each layer's in its input order."""
        outside = self.outside(stage)
        return [pair for name in reversed(stage.layers) for pair in outside if pair[0] == name]

    def forward(self) -> None:
        for stage in self.stages:
            for consumer, producer in self.outside(stage):
                planned = self.planned[consumer]
                moves = transfers(producer.samples, planned.samples)
                ranks = max(producer.gpus, planned.gpus)
                phases = self.phase(f"reshard:{consumer}", ranks, producer.gpus != planned.gpus)
                op = Op(kind=OpKind.RESHARD, layer=consumer, stage=stage.index, producer=producer.name,
                        transfers=moves, phases=phases)
                self.emit(op, ranks=ranks)
            phases = tuple(index for name in stage.layers
                           for index in self.phase(f"forward:{name}", stage.gpus, self.planned[name].fwd_ms > 0))
            self.emit(Op(kind=OpKind.FORWARD, layer=stage.name, stage=stage.index, phases=phases), ranks=stage.gpus)
            if self.graph.output in stage.layers:
                self.emit(Op(kind=OpKind.LOSS, layer=stage.name, stage=stage.index), ranks=stage.gpus)

    def backward(self) -> None:
        for stage in reversed(self.stages):
            backward: list[int] = []
            allreduce: list[int] = []
            for name in reversed(stage.layers):
                planned = self.planned[name]
                backward.extend(self.phase(f"backward:{name}", stage.gpus, planned.bwd_ms > 0))
                allreduce.extend(self.phase(f"allreduce:{name}", stage.gpus, planned.allreduce_ms > 0))
            for kind, phases in ((OpKind.BACKWARD, backward), (OpKind.ALLREDUCE, allreduce)):
                self.emit(Op(kind=kind, layer=stage.name, stage=stage.index, phases=tuple(phases)), ranks=stage.gpus)
            for consumer, producer in self.backward_order(stage):
                planned = self.planned[consumer]
                moves = transfers(producer.samples, planned.samples) if self.flows[producer.name] else ()
                ranks = max(producer.gpus, planned.gpus)
                phases = self.phase(f"reshard:{consumer}", ranks, producer.gpus != planned.gpus)
                op = Op(kind=OpKind.RESHARD_GRAD, layer=consumer, stage=stage.index, producer=producer.name,
                        transfers=moves, phases=phases)
                self.emit(op, ranks=ranks)

    def steps(self) -> None:
        """One optimizer-step op per stage (phases per layer); the engine steps once, at the last."""
        for stage in self.stages:
            phases = tuple(index for name in stage.layers
                           for index in self.phase(f"step:{name}", stage.gpus, self.planned[name].step_ms > 0))
            self.emit(Op(kind=OpKind.STEP, layer=stage.name, stage=stage.index, phases=phases), ranks=stage.gpus)


def idle_positions(program: Program, windows: list[IdleWindow]) -> dict[int | None, IdleWindow]:
    """Tie each of the rank's idle windows to the phase index after which it begins.

    Reconstructs the windows the way :func:`deeppool.plans.plan.idle_windows`
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


def whole_idle_ranks(plan: Plan) -> tuple[int, ...]:
    """The ranks that run no layer of the plan: idle for the whole iteration (a lendable GPU)."""
    return tuple(range(max((layer.gpus for layer in plan.layers), default=plan.gpus), plan.gpus))


def pace_group(plan: Plan) -> tuple[int, ...] | None:
    """Rank 0 and the :func:`whole_idle_ranks`: with an idle listener, the idle ranks follow rank 0's
    iterations, which it marks with a one-element send to each (None: no rank is wholly idle)."""
    idle = whole_idle_ranks(plan)
    return (0, *idle) if idle else None
