"""Per-step figures of every rank, on every rank: step and compute times, and stragglers.

After every ``every`` optimizer steps (``--monitor-every``, 10 by default) every
rank all-gathers one short row per step (one collective of ``8 × (5 + stages)``
bytes per rank and step): its step time, its share of the step's mean loss, the step's samples, its
compute time (the
step's compute spans: forward, backward, loss, optimizer, less the
communication spans inside them, SyncBatchNorm's reductions; never time spent
waiting in communication), rank 0's gradient noise scale, and per stage its
forward and backward time, measured the same way. On a GPU the spans are
device time; on CPU, the thread's CPU time (``time.thread_time``), since CPU
ranks that share cores also wait for a core, and that wait is the machine's
load, not the rank's speed (``docs/notes/0024-straggler-detector-settings.md``).

Stragglers are found per rank group, as ranks do different work in a burst
plan: the stages on ranks ``0..g−1`` form the group of size ``g`` (a
data-parallel plan has one group of every rank). A rank's time in a group is
the sum over the group's stages of its forward and backward time, scaled to
an even share of each stage's samples (``t · n̄ / n_r``, so a rank holding
more rows is not slow for that). Each group has its own
:class:`~deeppool.adaptation.stragglers.StragglerDetector`; a rank is
reported once while some group flags it.

Every rank holds the same rows after the all-gather, so every rank builds the
same figures (and a policy fed them decides the same everywhere).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

from deeppool.adaptation.stragglers import Straggler, StragglerDetector
from deeppool.executor.engine.comm import Comm
from deeppool.executor.engine.program import Stage
from deeppool.executor.engine.timing import Category, Recorder
from deeppool.plans import Plan

_STAGES = 5
"""Where a row's per-stage times begin (after step time, compute time, noise scale, loss share, samples)."""
ALPHA = 0.05
"""The smoothing of the relative speed (an effective window of about ``2/α`` = 40 steps)."""
PATIENCE = 30
"""Steps a rank's smoothed relative speed must stay below the threshold: with :data:`ALPHA`, a rank at half
speed is reported within about 40 steps, if they last :data:`MIN_SLOW_MS`."""
MIN_SLOW_MS = 2000.0
"""Wall time a rank must stay slow, so that a shared core's slow stretches (a fraction of a second, which at
millisecond steps is many steps) are not reported; steps of 70 ms or more meet it with :data:`PATIENCE` alone
(the figures behind it: ``docs/notes/0024-straggler-detector-settings.md``)."""


@dataclass(frozen=True, kw_only=True)
class StepLine:
    """One optimizer step of the whole run: what ``deeppool run --tensorboard`` shows for it."""

    step: int
    loss: float
    """The global mean loss: the sum of the ranks' shares."""
    iteration_ms: float
    """The slowest rank's step time."""
    samples: int
    gns: float | None

    def to_json(self) -> dict[str, float | int | None]:
        return {"step": self.step, "loss": self.loss, "iteration_ms": self.iteration_ms, "samples": self.samples,
                "gns": self.gns}


@dataclass(frozen=True, kw_only=True)
class StepFigures:
    """One optimizer step, as every rank sees it."""

    step: int
    step_ms: tuple[float, ...]
    compute_ms: tuple[float, ...]
    gns: float | None
    found: tuple[Straggler, ...]
    """Ranks newly reported as stragglers at this step."""
    flagged: tuple[Straggler, ...]
    """Every rank reported and not recovered."""
    lines: tuple[StepLine, ...] = ()
    """Every step gathered this time, in order."""


class StepMonitor:
    def __init__(self, plan: Plan, stages: tuple[Stage, ...], comm: Comm, recorder: Recorder, *,
                 every: int = 10) -> None:
        """``every``: steps per all-gather (their rows go together; the detectors still see every step)."""
        self.comm, self.recorder = comm, recorder
        self.stages, self.every = stages, every
        self._cursor = 0
        self._pending: list[tuple[int, list[float]]] = []
        self._share = {stage.index: _share(plan, stage) for stage in stages}
        self._groups: dict[int, list[Stage]] = defaultdict(list)
        for stage in stages:
            if stage.gpus > 1:
                self._groups[stage.gpus].append(stage)
        self.detectors = {gpus: StragglerDetector(alpha=ALPHA, patience=PATIENCE, min_slow_ms=MIN_SLOW_MS)
                          for gpus in self._groups}
        self.reported: dict[int, Straggler] = {}

    def record(self, step: int, gns: float | None = None, loss: float = 0.0, samples: int = 0) -> None:
        """Keep this rank's row of the step just run (its spans since the last call; ``loss``: its share of
        the step's mean loss; ``samples``: the step's global batch)."""
        self._pending.append((step, self._row(gns, loss, samples)))

    @property
    def due(self) -> bool:
        """``every`` steps are recorded: time to gather."""
        return len(self._pending) >= self.every

    def gather(self, step: int) -> StepFigures | None:
        """All ranks' recorded rows (a collective), fed to the detectors step by step; None if none."""
        if not self._pending:
            return None
        steps = [done for done, _ in self._pending]
        mine = [value for _, row in self._pending for value in row]
        self._pending = []
        with self.recorder.span(step, "monitor", Category.COMM):  # its cost shows in the trace
            gathered = self.comm.all_gather(mine)
        width = len(mine) // len(steps)
        found: list[Straggler] = []
        lines: list[StepLine] = []
        for i, done in enumerate(steps):
            rows = [theirs[i * width:(i + 1) * width] for theirs in gathered]
            found += self._detect(done, rows)
            lines.append(StepLine(step=done, loss=sum(row[3] for row in rows), iteration_ms=max(row[0] for row in rows),
                                  samples=int(rows[0][4]), gns=None if math.isnan(rows[0][2]) else rows[0][2]))
        return StepFigures(
            step=step, step_ms=tuple(row[0] for row in rows), compute_ms=tuple(row[1] for row in rows),
            gns=lines[-1].gns, found=tuple(found), flagged=tuple(self.reported.values()), lines=tuple(lines),
        )

    def _row(self, gns: float | None, loss: float, samples: int) -> list[float]:
        spans = self.recorder.spans[self._cursor:]
        self._cursor = len(self.recorder.spans)
        comm = [span for span in spans if span.category is Category.COMM]
        by_label: dict[str, float] = defaultdict(float)
        step_ms = compute_ms = 0.0
        for span in spans:
            if span.category is Category.ITERATION:
                step_ms += span.ms
            elif span.category is Category.COMPUTE:
                inside = sum(c.busy_ms for c in comm if span.start_s <= c.start_s and c.end_s <= span.end_s)
                compute_ms += span.busy_ms - inside
                by_label[span.label] += span.busy_ms - inside
        stages = [by_label[f"forward:{s.name}"] + by_label[f"backward:{s.name}"] for s in self.stages]
        return [step_ms, compute_ms, math.nan if gns is None else gns, loss, float(samples), *stages]

    def _detect(self, step: int, rows: list[tuple[float, ...]]) -> list[Straggler]:
        flagged: set[int] = set()
        found: dict[int, Straggler] = {}
        for gpus, stages in self._groups.items():
            times = {rank: sum(rows[rank][_STAGES + s.index] * self._share[s.index][rank] for s in stages)
                     for rank in range(gpus)}
            detector = self.detectors[gpus]
            for straggler in detector.observe(step, times, max(rows[rank][0] for rank in range(gpus))):
                found.setdefault(straggler.rank, straggler)
            flagged |= detector.flagged
        for rank in list(self.reported):
            if rank not in flagged:
                del self.reported[rank]
        new = [s for rank, s in sorted(found.items()) if rank not in self.reported]
        self.reported.update((s.rank, s) for s in new)
        return new


def _share(plan: Plan, stage: Stage) -> dict[int, float]:
    """Per rank of the stage, the even share of its samples over the rank's own: ``n̄ / n_r``."""
    samples = {layer.name: layer.samples for layer in plan.layers}[stage.layers[0]]
    rows = {rank: end - start for rank, (start, end) in enumerate(samples[:stage.gpus])}
    mean = sum(rows.values()) / len(rows)
    return {rank: mean / n if n > 0 else 0.0 for rank, n in rows.items()}
