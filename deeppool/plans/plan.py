"""Plan: the contract between planning and running (JSON, versioned, validated on load).

A Plan names, for every layer, its GPU count, the ranks that run it and each
rank's sample range of the global batch, with the predicted times; then the
predicted iteration and the idle windows that background jobs will get, and
how the solver did. :func:`deeppool.planner.solve.build.build_plan` derives all
of it from an assignment ``{layer: gpus}`` through the cost model, so nothing in
a Plan is computed twice in two ways.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deeppool.errors import DeeppoolError
from deeppool.plans.branch import Branch
from deeppool.plans.enums import Combine, Objective, Optimizer, Precision, Strategy
from deeppool.plans.goodput import GoodputSearch
from deeppool.plans.jsonio import check_version, field, read_json, write_json
from deeppool.plans.network import NetworkModel
from deeppool.plans.pin import Pin
from deeppool.plans.spec import ModelSpec

PLAN_SCHEMA_VERSION = 1


def sample_ranges(global_batch: int, gpus: int) -> tuple[tuple[int, int], ...]:
    """Rank ``i`` of ``gpus`` holds samples [⌊i·B/g⌋, ⌊(i+1)·B/g⌋)."""
    return tuple(
        (rank * global_batch // gpus, (rank + 1) * global_batch // gpus) for rank in range(gpus)
    )


@dataclass(frozen=True, kw_only=True)
class PlannedLayer:
    name: str
    op: str
    gpus: int
    ranks: tuple[int, ...]
    samples: tuple[tuple[int, int], ...]
    fwd_ms: float
    bwd_ms: float
    allreduce_ms: float
    step_ms: float
    amplification: float
    memory_bytes: int
    spread: float = 0.0
    """The relative spread of the repeated measurements its forward and backward rest on (0: not
    measured here, e.g. a device model's estimate); absent in older plans."""
    opaque: str = ""
    """Why the layer is one submodule run eagerly, not traced (the tracer's error, one line); empty when traced."""

    @property
    def busy_ms(self) -> float:
        """The time the layer holds its GPUs in one iteration (reshards excluded)."""
        return self.fwd_ms + self.bwd_ms + self.allreduce_ms + self.step_ms


@dataclass(frozen=True, kw_only=True)
class IdleWindow:
    """A stretch of one iteration in which ``rank`` has no foreground work."""

    rank: int
    start_ms: float
    end_ms: float
    after: str | None

    @property
    def length_ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass(frozen=True, kw_only=True)
class Prediction:
    iteration_ms: float
    data_parallel_iteration_ms: float
    deeppool_iteration_ms: float
    speedup_vs_data_parallel: float
    gpu_seconds_per_iteration: float
    amplification: float
    idle_gpu_fraction: float
    peak_memory_bytes: int
    idle_windows: tuple[IdleWindow, ...]
    best_data_parallel_gpus: int = 0
    best_data_parallel_iteration_ms: float = 0.0
    speedup_vs_best_data_parallel: float = 0.0
    step_call_ms: float = 0.0
    """The optimizer's per-call cost in ``iteration_ms`` (``OPT_call`` of :mod:`deeppool.planner.solve.cost`)."""
    loss_ms: float = 0.0
    """The loss's forward and backward, part of the output layer's ``fwd_ms`` and ``bwd_ms``."""
    uncertainty: float = 0.0
    """The iteration's relative uncertainty: its layers' forward and backward times weighted by the spread
    of the measurements each rests on, over the iteration (0: not measured here)."""


WEAK = 0.15
"""A prediction whose uncertainty exceeds this (±15%) is reported as weak."""


@dataclass(frozen=True, kw_only=True)
class Evidence:
    """What a plan measured here rests on: the per-GPU batches measured; the layers whose per-GPU batch in
    this plan was not measured (above ``--max-measured-batch`` or too large for a profiling pass here:
    extrapolated from the fitted line); the per-GPU batches the plan or its baselines use that were not
    measured; the layers resting on measurements taken on a busy machine or that stayed noisy; the highest
    load average seen while measuring, and the host's cores."""

    measured_batches: tuple[int, ...]
    extrapolated: tuple[str, ...] = ()
    unmeasured_batches: tuple[int, ...] = ()
    busy: tuple[str, ...] = ()
    load: float = 0.0
    cores: int = 1
    sharing: dict[int, float] = dataclasses.field(default_factory=dict)
    """For each count ``g > 1`` of the plan, how much slower each of ``g`` ranks computing at once runs than
    one alone, as the profile has it (:meth:`Profile.sharing`): the factor the plan's compute on ``g`` ranks
    was scaled by, for comparison with the host at the run."""

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "measured_batches": list(self.measured_batches), "extrapolated": list(self.extrapolated),
                "unmeasured_batches": list(self.unmeasured_batches), "busy": list(self.busy),
                "sharing": {str(g): factor for g, factor in sorted(self.sharing.items())}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Evidence:
        return cls(measured_batches=tuple(int(b) for b in data["measured_batches"]),
                   extrapolated=tuple(str(n) for n in data.get("extrapolated", ())),
                   unmeasured_batches=tuple(int(b) for b in data.get("unmeasured_batches", ())),
                   busy=tuple(str(n) for n in data.get("busy", ())), load=float(data.get("load", 0.0)),
                   cores=int(data.get("cores", 1)),
                   sharing={int(g): float(f) for g, f in dict(data.get("sharing") or {}).items()})


@dataclass(frozen=True, kw_only=True)
class ClusterShares:
    """The cluster's throughput under the plan, over data parallel on all GPUs, and the strong baseline.

    ``fg_share + bg_share`` as :mod:`deeppool.planner.solve.throughput` defines it (background work in the plan's
    idle windows at ``interference``'s efficiencies); ``right_sizing_throughput``: data parallel at its best
    width ``right_sizing_gpus`` with the GPUs it leaves doing background work at full efficiency.
    """

    fg_share: float
    bg_share: float
    lent_fraction: float
    right_sizing_gpus: int
    right_sizing_throughput: float
    interference: str
    """Where the efficiencies came from: an interference.json path, or ``defaults``."""

    @property
    def throughput(self) -> float:
        return self.fg_share + self.bg_share

    @property
    def vs_right_sizing(self) -> float:
        return self.throughput / self.right_sizing_throughput if self.right_sizing_throughput > 0 else 1.0


@dataclass(frozen=True, kw_only=True)
class SolverInfo:
    name: str
    status: str
    seconds: float
    gap: float


@dataclass(frozen=True, kw_only=True)
class Plan:
    model: ModelSpec
    global_batch: int
    gpus: int
    device: str
    network: NetworkModel
    strategy: Strategy
    optimizer: Optimizer
    amplification_limit: float | None
    layers: tuple[PlannedLayer, ...]
    predicted: Prediction
    solver: SolverInfo
    precision: Precision = Precision.FP32
    combine: Combine = Combine.SUM
    """How each layer group combines its gradients (``deeppool plan --combine``); absent in older plans: sum."""
    goodput: GoodputSearch | None = None
    """With ``--batch auto``: every candidate batch's figures; ``global_batch`` is the goodput-optimal one."""
    pins: tuple[Pin, ...] = ()
    """The layer counts the user fixed (``--pin``); absent in older plans: none."""
    objective: Objective = Objective.TIME
    """What the ILP strategy optimised (``--objective``); absent in older plans: time."""
    cluster: ClusterShares | None = None
    """The cluster's throughput under the plan; absent in older plans."""
    branches: tuple[Branch, ...] = ()
    """Branches on tensor values the tracer specialised (file, line, the way taken): ``run`` checks them."""
    draws: tuple[Branch, ...] = ()
    """Where the model draws random numbers outside the graph (those branches' draws)."""
    preconditioned: tuple[str, ...] = ()
    """With ``--optimizer kfac``: the layers K-FAC preconditions (their ``step_ms`` holds its time); every other
    layer keeps the plain gradient. Absent from the JSON when empty."""
    evidence: Evidence | None = None
    """With layer times measured here: what the plan rests on; absent for a device model's estimate."""
    schema_version: int = PLAN_SCHEMA_VERSION

    def __post_init__(self) -> None:
        validate(self)

    @property
    def assignment(self) -> dict[str, int]:
        return {layer.name: layer.gpus for layer in self.layers}

    def idle_windows(self, rank: int) -> list[IdleWindow]:
        return [w for w in self.predicted.idle_windows if w.rank == rank]

    def to_json(self, *, base: Path | None = None) -> dict[str, Any]:
        """The JSON form; with ``base`` (the plan file's folder) the model's paths are relative to it."""
        return {
            "artifact": "plan",
            "schema_version": self.schema_version,
            "model": self.model.to_json(base=base),
            "global_batch": self.global_batch,
            "gpus": self.gpus,
            "device": self.device,
            "network": self.network.to_json(),
            "strategy": self.strategy.value,
            "optimizer": self.optimizer.value,
            "precision": self.precision.value,
            "combine": self.combine.value,
            "amplification_limit": self.amplification_limit,
            "layers": [asdict(layer) for layer in self.layers],
            "predicted": asdict(self.predicted),
            "solver": asdict(self.solver),
            "pins": [pin.to_json() for pin in self.pins],
            "objective": self.objective.value,
            **({"cluster": asdict(self.cluster)} if self.cluster is not None else {}),
            **({"goodput": self.goodput.to_json()} if self.goodput is not None else {}),
            **({"branches": [branch.to_json() for branch in self.branches]} if self.branches else {}),
            **({"draws": [draw.to_json() for draw in self.draws]} if self.draws else {}),
            **({"evidence": self.evidence.to_json()} if self.evidence is not None else {}),
            **({"preconditioned": list(self.preconditioned)} if self.preconditioned else {}),
        }

    @classmethod
    def from_json(cls, data: Any, *, where: str = "input", base: Path | None = None) -> Plan:
        payload = check_version(data, kind="plan", schema_version=PLAN_SCHEMA_VERSION, where=where)
        try:
            predicted = dict(field(payload, "predicted", kind="plan"))
            predicted["idle_windows"] = tuple(IdleWindow(**w) for w in predicted["idle_windows"])
            limit = payload.get("amplification_limit")
            return cls(
                model=ModelSpec.from_json(field(payload, "model", kind="plan"), base=base),
                global_batch=int(field(payload, "global_batch", kind="plan")),
                gpus=int(field(payload, "gpus", kind="plan")),
                device=str(field(payload, "device", kind="plan")),
                network=NetworkModel.from_json(field(payload, "network", kind="plan")),
                strategy=Strategy(field(payload, "strategy", kind="plan")),
                optimizer=Optimizer(field(payload, "optimizer", kind="plan")),
                precision=Precision(payload.get("precision", Precision.FP32.value)),
                combine=Combine(payload.get("combine", Combine.SUM.value)),
                amplification_limit=None if limit is None else float(limit),
                layers=tuple(_planned_layer(item) for item in field(payload, "layers", kind="plan")),
                predicted=Prediction(**predicted),
                solver=SolverInfo(**field(payload, "solver", kind="plan")),
                goodput=GoodputSearch.from_json(payload["goodput"]) if "goodput" in payload else None,
                pins=tuple(Pin.from_json(item) for item in payload.get("pins", ())),
                objective=Objective(payload.get("objective", Objective.TIME.value)),
                cluster=ClusterShares(**payload["cluster"]) if "cluster" in payload else None,
                branches=tuple(Branch.from_json(item) for item in payload.get("branches", ())),
                draws=tuple(Branch.from_json(item) for item in payload.get("draws", ())),
                evidence=Evidence.from_json(payload["evidence"]) if payload.get("evidence") else None,
                preconditioned=tuple(str(name) for name in payload.get("preconditioned", ())),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise DeeppoolError(f"plan {where} is malformed ({type(err).__name__}: {err}): regenerate it") from None

    def save(self, path: str | Path) -> None:
        """Write the plan; the model's paths are stored relative to the plan file, so the pair can move."""
        write_json(path, self.to_json(base=Path(path).resolve().parent))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        payload = read_json(path, kind="plan", schema_version=PLAN_SCHEMA_VERSION)
        return cls.from_json(payload, where=f"file '{path}'", base=Path(path).resolve().parent)


def _planned_layer(item: dict[str, Any]) -> PlannedLayer:
    return PlannedLayer(
        **{
            **item,
            "ranks": tuple(item["ranks"]),
            "samples": tuple(tuple(pair) for pair in item["samples"]),
        }
    )


def validate(plan: Plan) -> None:
    """Refuse an inconsistent plan, naming the layer and rank at fault."""
    if plan.gpus < 1 or plan.global_batch < 1:
        raise DeeppoolError(f"plan has gpus={plan.gpus}, global_batch={plan.global_batch}: both must be >= 1")
    if not plan.layers:
        raise DeeppoolError("plan has no layers")
    for layer in plan.layers:
        if not 1 <= layer.gpus <= plan.gpus:
            raise DeeppoolError(f"layer '{layer.name}' uses {layer.gpus} GPUs, outside 1..{plan.gpus}")
        if layer.ranks != tuple(range(layer.gpus)):
            raise DeeppoolError(f"layer '{layer.name}': ranks must be 0..{layer.gpus - 1}")
        expected = sample_ranges(plan.global_batch, layer.gpus)
        for rank, (got, want) in enumerate(zip(layer.samples, expected, strict=False)):
            if tuple(got) != want:
                raise DeeppoolError(
                    f"layer '{layer.name}' rank {rank}: samples {list(got)} should be {list(want)}"
                )
        if len(layer.samples) != layer.gpus:
            raise DeeppoolError(f"layer '{layer.name}': {len(layer.samples)} sample ranges for {layer.gpus} ranks")


