"""A scripted resize: one job moved through given widths, for measuring and testing resizes on live jobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from deeppool.scheduling.contract import Decision, PlanMode, Snapshot, Start
from deeppool.scheduling.policies import POLICIES


@dataclass
class ScriptedResizes:
    """FIFO with backfilling, and job ``job_id`` moved to each of ``widths`` in turn.

    A move is asked (at every decision: a resize under way refuses another) once the job has made a step of
    progress on its last width, so a resize happens at a moment of the run's, not a timer's. ``reached``
    holds the job's progress at each width it reached.
    """

    job_id: int
    widths: list[int]
    name: str = "scripted-resizes"
    reached: list[float] = field(default_factory=list)

    def decide(self, snap: Snapshot) -> Decision:
        state, held = snap.adaptive.get(self.job_id), snap.holding.get(self.job_id)
        if self.widths and state is not None and held == self.widths[0]:
            self.widths.pop(0)
            self.reached.append(state.progress)
        if self.widths and state is not None and held is not None and state.progress > max(self.reached,
                                                                                            default=0.0) + 1:
            return Decision(preempt=(self.job_id,), start=(Start(job_id=self.job_id, gpus=self.widths[0],
                                                                 mode=PlanMode.BURST),))
        return POLICIES["fifo-backfill"].decide(snap)
