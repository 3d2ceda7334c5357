"""Keeping the database and the processes in agreement: start, observe, finalise, stop, recover.

:meth:`Runtime.start` moves a job PENDING → STARTING (a committed
compare-and-swap) and only then launches its supervisor. :meth:`reconcile`,
run when the server starts (before it serves) and then periodically, looks at
every live job's current attempt:

* its supervisor wrote an exit code: SUCCEEDED (0) or FAILED (the code);
* its supervisor runs: a STARTING job becomes RUNNING (after a restart, that
  is re-adoption; the job never stopped);
* its supervisor is gone without an exit code: FAILED, "lost";
* no supervisor ever took the attempt's lock, ``grace_s`` after the job
  became STARTING: the coordinator died between its commit and the launch, so
  it launches now. The supervisor's lock file makes a second launch of the
  same attempt a no-op, so nothing runs twice.

Jobs CANCELLED while running are stopped (SIGTERM, grace, SIGKILL).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from deeppool.coordinator.jobs import Job, JobStatus
from deeppool.coordinator.launcher import LocalLauncher, Phase
from deeppool.coordinator.store import Store

Steps = Callable[[Job], list[list[str]]]


class Runtime:
    def __init__(self, store: Store, launcher: LocalLauncher, steps: Steps, *, grace_s: float = 5.0) -> None:
        self.store, self.launcher, self.steps, self.grace_s = store, launcher, steps, grace_s

    def start(self, job: Job, reason: str) -> bool:
        """Claim the job (PENDING → STARTING) and launch its next attempt; False if someone else moved it."""
        if not self.store.transition(job.id, JobStatus.STARTING, reason):
            return False
        self.launcher.launch(job.id, self.store.attempts(job.id), self.steps(job))
        return True

    def requeue(self, job: Job, reason: str) -> None:
        """Preempt a running job: stop its attempt and put it back in the queue (not failed)."""
        if self.store.transition(job.id, JobStatus.PENDING, reason):
            self.launcher.stop(job.id, self.store.attempts(job.id), self.grace_s)

    def reconcile(self, now: datetime | None = None) -> None:
        now = now or datetime.now(UTC)
        for job in self.store.jobs(states=(JobStatus.STARTING, JobStatus.RUNNING)):
            self._settle(job, now)
        for job in self.store.jobs(states=(JobStatus.CANCELLED,)):
            attempt = self.store.attempts(job.id)
            if attempt and self.launcher.observe(job.id, attempt).phase is Phase.RUNNING:
                self.launcher.stop(job.id, attempt, self.grace_s)

    def _settle(self, job: Job, now: datetime) -> None:
        attempt = self.store.attempts(job.id)
        seen = self.launcher.observe(job.id, attempt)
        if seen.phase is Phase.EXITED:
            ok = seen.exit_code == 0
            self.store.transition(job.id, JobStatus.SUCCEEDED if ok else JobStatus.FAILED,
                                  "finished" if ok else f"exited with code {seen.exit_code}", exit_code=seen.exit_code)
        elif seen.phase is Phase.RUNNING and job.state is JobStatus.STARTING:
            self.store.transition(job.id, JobStatus.RUNNING, f"attempt {attempt} running")
        elif seen.phase is Phase.LOST:
            self.store.transition(job.id, JobStatus.FAILED, f"lost: attempt {attempt}'s supervisor ended without an "
                                                            "exit code")
        elif seen.phase is Phase.NOT_STARTED and now - job.updated_at > timedelta(seconds=self.grace_s):
            self.launcher.launch(job.id, attempt, self.steps(job))
