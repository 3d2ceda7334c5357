"""What a run measured, merged over ranks, next to what the plan predicted."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from deeppool.executor.engine.data import DataReport
from deeppool.executor.engine.program import Stage
from deeppool.executor.engine.timing import RankTimes
from deeppool.executor.training.adapt import AdaptationReport
from deeppool.executor.training.reference import CheckResult, worst_of
from deeppool.plans import Plan


@dataclass(frozen=True, kw_only=True)
class StageTiming:
    """Per-stage ms: predicted by the plan (the sum over its layers), measured (slowest rank of the stage);
    the output layer's stage's forward includes the loss, as the plan's output layer does."""

    name: str
    layers: tuple[str, ...]
    gpus: int
    fwd_predicted: float
    fwd_measured: float
    bwd_predicted: float
    bwd_measured: float
    allreduce_predicted: float
    allreduce_measured: float | None


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    gpus: int
    global_batch: int
    steps: int
    measured_steps: int
    iteration_predicted_ms: float
    iteration_measured_ms: float
    losses: tuple[float, ...]
    stages: tuple[StageTiming, ...]
    check: CheckResult | None
    adaptation: dict[str, Any] = field(default_factory=dict)
    """``gns`` (samples), ``gns_stats`` and ``adascale`` (τ, last gain) when measured."""
    precision: str = "fp32"
    data: DataReport | None = None
    """``--data``: the dataset's size, epochs and position (None for the synthetic batch or a loader)."""
    adapted: AdaptationReport | None = None
    """Stragglers and a policy's actions (:mod:`deeppool.executor.training.adapt`)."""

    @property
    def iterations_per_s(self) -> float:
        return 1e3 / self.iteration_measured_ms if self.iteration_measured_ms > 0 else 0.0

    @property
    def samples_per_s(self) -> float:
        return self.iterations_per_s * self.global_batch

    def to_json(self) -> dict[str, Any]:
        return {
            "gpus": self.gpus,
            "global_batch": self.global_batch,
            "steps": self.steps,
            "measured_steps": self.measured_steps,
            "iteration_predicted_ms": self.iteration_predicted_ms,
            "iteration_measured_ms": self.iteration_measured_ms,
            "iterations_per_s": self.iterations_per_s,
            "samples_per_s": self.samples_per_s,
            "losses": list(self.losses),
            "stages": [asdict(stage) for stage in self.stages],
            "check": None if self.check is None else self.check.to_json(),
            **self.adaptation,
            **(self.adapted.to_json() if self.adapted is not None else {}),
            "precision": self.precision,
            "data": None if self.data is None else self.data.to_json(),
        }


def summarise_run(
    plan: Plan,
    stages: tuple[Stage, ...],
    times: list[RankTimes],
    losses: list[tuple[float, ...]],
    checks: list[CheckResult | None],
    *,
    steps: int,
    synchronous_allreduce: bool,
    adaptation: dict[str, Any] | None = None,
    adapted: AdaptationReport | None = None,
) -> RunSummary:
    """Merge every rank's medians and loss shares into one summary (on rank 0)."""
    planned = {layer.name: layer for layer in plan.layers}

    def slowest(label: str, gpus: int) -> float:
        return max(t.labels.get(label, 0.0) for t in times if t.rank < gpus)

    def predicted(stage: Stage, part: str) -> float:
        return sum(getattr(planned[name], part) for name in stage.layers)

    timings = tuple(
        StageTiming(
            name=stage.name,
            layers=stage.layers,
            gpus=stage.gpus,
            fwd_predicted=predicted(stage, "fwd_ms"),
            fwd_measured=slowest(f"forward:{stage.name}", stage.gpus) + slowest(f"loss:{stage.name}", stage.gpus),
            bwd_predicted=predicted(stage, "bwd_ms"),
            bwd_measured=slowest(f"backward:{stage.name}", stage.gpus),
            allreduce_predicted=predicted(stage, "allreduce_ms"),
            allreduce_measured=slowest(f"allreduce:{stage.name}", stage.gpus) if synchronous_allreduce else None,
        )
        for stage in stages
    )
    check = worst_of([c for c in checks if c is not None])
    return RunSummary(
        gpus=plan.gpus,
        global_batch=plan.global_batch,
        steps=steps,
        measured_steps=min(t.steps for t in times),
        iteration_predicted_ms=plan.predicted.iteration_ms,
        iteration_measured_ms=max(t.iteration_ms for t in times),
        losses=tuple(sum(column) for column in zip(*losses, strict=True)),
        stages=timings,
        check=check,
        adaptation=adaptation or {},
        adapted=adapted,
    )
