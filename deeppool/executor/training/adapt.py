"""The training loop's adaptation: monitoring every step, a policy's hooks, and applying their actions.

:class:`Adapter` holds what a policy may change mid-run: the micro-batches per
optimizer step ``K`` (``--accumulate``), the base learning rate, and the data
position (global batches trained on, ``Σ K`` over the steps, which indexes
the data and the per-sample random draws, so changing ``K`` keeps the run
exact). After every optimizer step it gathers the step's figures
(:class:`~deeppool.executor.training.steptimes.StepMonitor`), reports new stragglers and
calls the policy (:mod:`deeppool.adaptation.policy`).

Rank 0 reports what happens (stragglers, actions) on the console and as one
JSON line each in ``<out>/events.jsonl``, which the coordinator relays into the
job's event log. A :class:`~deeppool.adaptation.policy.RequestGpus` ends the
run after the step: the loop writes a checkpoint and rank 0 writes
``<out>/resize.json`` for the command line to re-plan.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from deeppool.adaptation.policy import Action, AdaptationPolicy, RequestGpus, SetAccumulate, SetLr, TrainingSnapshot
from deeppool.adaptation.stragglers import Straggler
from deeppool.executor.training.steptimes import StepFigures, StepLine, StepMonitor
from deeppool.executor.training.outputs import EVENTS, STEPS


@dataclass(frozen=True, kw_only=True)
class Progress:
    """What a checkpoint keeps beyond the weights for a resumed run to continue exactly."""

    accumulate: int
    position: int
    lr: float
    """the base learning rate in effect (a policy's change included)"""
    asked_lr: float | None = None
    """the learning rate the run that wrote it was asked for (``--lr``; None in checkpoints from before it was
    kept): a run resumed with another asked LR scales ``lr`` by their ratio (:meth:`asked`)"""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def asked(self, lr: float) -> Progress:
        """This progress for a resumed run asked for learning rate ``lr``: the base LR scaled by ``lr`` over the
        one the checkpointing run was asked for (a coordinator's batch change asks ``base × AdaScale's gain``),
        so a policy's change to it carries over; unchanged when they agree or the checkpoint does not say."""
        if self.asked_lr is None or self.asked_lr == lr:
            return replace(self, asked_lr=lr)
        return replace(self, lr=self.lr * lr / self.asked_lr, asked_lr=lr)


@dataclass(frozen=True, kw_only=True)
class Resize:
    """A policy's request for another GPU count: ``<out>/resize.json``."""

    gpus: int
    steps_done: int
    checkpoint: str
    reason: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, kw_only=True)
class AdaptationReport:
    """What a run adapted, for ``summary.json``: stragglers, the policy's actions, where it ended."""

    stragglers: tuple[Straggler, ...]
    actions: tuple[dict[str, Any], ...]
    accumulate: int
    lr: float
    requested_gpus: int | None

    def to_json(self) -> dict[str, Any]:
        return {"stragglers": [s.to_json() for s in self.stragglers],
                "policy": {"actions": list(self.actions), "accumulate": self.accumulate, "lr": self.lr,
                           "requested_gpus": self.requested_gpus}}


@dataclass(kw_only=True)
class EventLog:
    """Rank 0's report of what the run adapted: printed, and appended to ``<out>/events.jsonl``."""

    out_dir: Path | None
    show: Callable[[str], None]
    events: list[dict[str, Any]] = field(default_factory=list)

    def write(self, kind: str, message: str, **fields: Any) -> None:
        record = {"kind": kind, "message": message, **fields}
        self.events.append(record)
        self.show(message)
        if self.out_dir is not None:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with (self.out_dir / EVENTS).open("a") as handle:
                handle.write(json.dumps(record) + "\n")


@dataclass(frozen=True, kw_only=True)
class StepLog:
    """Rank 0's per-step figures, appended to ``<out>/steps.jsonl`` as the ranks gather them."""

    out_dir: Path

    def write(self, lines: Sequence[StepLine]) -> None:
        if not lines:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with (self.out_dir / STEPS).open("a") as handle:
            handle.write("".join(json.dumps(line.to_json()) + "\n" for line in lines))


class Adapter:
    def __init__(self, *, monitor: StepMonitor, policy: AdaptationPolicy | None, progress: Progress, gpus: int,
                 global_batch: int, optimizer: torch.optim.Optimizer | None,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None, log: EventLog | None,
                 on_accumulate: Callable[[int], None] = lambda k: None,
                 on_lr: Callable[[float], None] = lambda lr: None, steps: StepLog | None = None) -> None:
        """``log`` is rank 0's (None elsewhere); ``on_accumulate`` hears of a new ``K`` (the noise-scale
        monitor's batch sizes follow it), ``on_lr`` of a new base LR (AdaScale's, which sets the LR itself)."""
        self.monitor, self.policy, self.progress = monitor, policy, progress
        self.on_accumulate, self.on_lr = on_accumulate, on_lr
        self.gpus, self.global_batch = gpus, global_batch
        self.optimizer, self.scheduler, self.log, self.steps = optimizer, scheduler, log, steps
        self.requested: RequestGpus | None = None
        self.stragglers: list[Straggler] = []
        self.actions: list[dict[str, Any]] = []
        self._last: StepFigures | None = None
        self._set_lr(progress.lr)

    @property
    def accumulate(self) -> int:
        return self.progress.accumulate

    def before_step(self, step: int) -> None:
        if self.policy is not None:
            self._apply(step, self.policy.before_step(self.snapshot(step)))

    def after_step(self, step: int, batches: int, *, last: bool, gns: float | None = None,
                   loss: float = 0.0) -> bool:
        """The step is done (``batches`` micro-batches; ``last``: the run's last step; ``loss``: this rank's
        share of its mean loss): monitor it, consult the policy; whether to stop."""
        self.progress = replace(self.progress, position=self.progress.position + batches)
        self.monitor.record(step, gns, loss, batches * self.global_batch)
        if last or self.monitor.due:
            self._found(self.monitor.gather(step))
        if self.policy is not None:
            self._apply(step + 1, self.policy.after_step(self.snapshot(step + 1)))
        if self.requested is not None:  # the run stops here: what is still recorded is gathered now
            self._found(self.monitor.gather(step))
        return self.requested is not None

    def flush(self, step: int) -> None:
        """The run stops after ``step`` for a reason of its own (a stop file): gather what is still recorded."""
        self._found(self.monitor.gather(step))

    def _found(self, figures: StepFigures | None) -> None:
        if figures is None:
            return
        self._last = figures
        if self.steps is not None:
            self.steps.write(figures.lines)
        for straggler in figures.found:
            self.stragglers.append(straggler)
            if self.log is not None:
                self.log.write("straggler", f"straggler: {straggler.describe()}", **straggler.to_json())

    def after_epoch(self, steps_done: int) -> bool:
        if self.policy is not None:
            self._apply(steps_done, self.policy.after_epoch(self.snapshot(steps_done)))
        return self.requested is not None

    def report(self) -> AdaptationReport:
        return AdaptationReport(stragglers=tuple(self.stragglers), actions=tuple(self.actions),
                                accumulate=self.progress.accumulate, lr=self.progress.lr,
                                requested_gpus=self.requested.gpus if self.requested else None)

    def snapshot(self, steps_done: int) -> TrainingSnapshot:
        last = self._last
        return TrainingSnapshot(
            step=steps_done, position=self.progress.position, gpus=self.gpus, global_batch=self.global_batch,
            accumulate=self.progress.accumulate, lr=self.progress.lr,
            step_ms=last.step_ms if last else (), compute_ms=last.compute_ms if last else (),
            gns=last.gns if last else None, stragglers=last.flagged if last else (),
        )

    def _apply(self, steps_done: int, actions: Sequence[Action]) -> None:
        for action in actions:
            if isinstance(action, SetLr):
                self._set_lr(action.lr)
                self.on_lr(action.lr)
                self._report(steps_done, "lr", f"policy: learning rate {action.lr:g} from step {steps_done}",
                             lr=action.lr)
            elif isinstance(action, SetAccumulate):
                self.progress = replace(self.progress, accumulate=action.accumulate)
                self.on_accumulate(action.accumulate)
                batch = action.accumulate * self.global_batch
                self._report(steps_done, "accumulate", f"policy: accumulate {action.accumulate} micro-batches "
                             f"(batch {batch}) from step {steps_done}", accumulate=action.accumulate, batch=batch)
            elif isinstance(action, RequestGpus):
                self.requested = self.requested or action
                why = f": {action.reason}" if action.reason else ""
                self._report(steps_done, "gpus", f"policy: asks for {action.gpus} GPUs after step {steps_done}{why}",
                             gpus=action.gpus, reason=action.reason)

    def _report(self, steps_done: int, kind: str, message: str, **fields: Any) -> None:
        self.actions.append({"kind": kind, "step": steps_done, **fields})
        if self.log is not None:
            self.log.write(kind, message, step=steps_done, **fields)

    def _set_lr(self, lr: float) -> None:
        """The base LR becomes ``lr``; the schedule's factor at the current step still applies."""
        self.progress = replace(self.progress, lr=lr)
        if self.optimizer is None:
            return
        factor = 1.0
        if isinstance(self.scheduler, torch.optim.lr_scheduler.LambdaLR):
            self.scheduler.base_lrs = [lr for _ in self.scheduler.base_lrs]
            factor = self.scheduler.lr_lambdas[0](self.scheduler.last_epoch)
        for group in self.optimizer.param_groups:
            group["initial_lr"] = lr
            group["lr"] = lr * factor
