"""Keeping the database and the processes in agreement: start, observe, finalise, stop, recover.

:meth:`Runtime.start` moves a job PENDING → STARTING (a committed
compare-and-swap) and only then launches its supervisor. :meth:`reconcile`,
run when the server starts (before it serves) and then periodically, looks at
every live job's current attempt:

* its supervisor wrote an exit code: SUCCEEDED (0) or FAILED (the code);
* its supervisor runs: a STARTING job becomes RUNNING (after a restart, that
  is re-adoption; the job never stopped); a batch system still queueing it:
  nothing to do;
* its supervisor is gone without an exit code: FAILED, "lost";
* no supervisor ever took the attempt's lock, ``grace_s`` after the job
  became STARTING: the coordinator died between its commit and the launch, so
  it launches now. The supervisor's lock file makes a second launch of the
  same attempt a no-op, so nothing runs twice.

Jobs CANCELLED while running are stopped (SIGTERM, grace, then every
process of the attempt killed); until their last process is gone they still
hold their GPUs (:meth:`Runtime.lingering`). One cancelled after its launch
but before its supervisor took the lock never runs (the launcher takes it).

Each job runs as the account :class:`~deeppool.coordinator.isolation.RunAs`
gives its owner (a job whose owner has none fails with the reason), in its own
folder ``job-N`` (0700, the account's). What a job wrote there is read only
through :func:`~deeppool.coordinator.isolation.read_job_file`: never through a
link, and only if the job's account owns it.

While a job runs, and once more when it ends, what its run reported in
``job-N/run/events.jsonl`` (stragglers, an adaptation policy's actions and
requests for another GPU count) is relayed into its event log, each line once
(:meth:`~deeppool.coordinator.store.Store.note`), and its progress (steps done
over steps asked, from rank 0's ``job-N/run/progress.json``) is recorded.
A foreground job spans ``nodes`` machines (a Slurm launcher's allocation:
``gpus / nodes`` on each); a background job on whole GPUs runs on one.

A background job lent a foreground job's idle windows (a *guest*) runs in
processes its host's ranks start, as the same account (the service lends a
host only guests whose owners' jobs run as its account), so it has no
supervisor of its own: it becomes RUNNING with its host, and when the host
ends it SUCCEEDED if it trained (the host's ``summary.json`` counts its
steps), else it goes back to the queue.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

from deeppool.coordinator.isolation import Account, RunAs, read_job_file
from deeppool.coordinator.jobs import Job, JobStatus
from deeppool.coordinator.launcher import Launcher, Phase, Resources, resources_for
from deeppool.coordinator.store import Store
from deeppool.executor.outputs import EVENTS, PROGRESS
from deeppool.errors import DeeppoolError

Steps = Callable[[Job, int, Sequence[Job]], list[list[str]]]
"""A job's steps for an attempt, given the guests lent its idle windows."""


class Runtime:
    def __init__(self, store: Store, launcher: Launcher, steps: Steps, *, grace_s: float = 5.0,
                 after_claim: Callable[[Job], None] | None = None, nodes: int = 1, run_as: RunAs = RunAs()) -> None:
        """``after_claim`` runs between the claim's commit and the launch: a fault-injection point for tests.

        ``nodes``: the machines each foreground job spans; ``run_as``: the account each job runs as.
        """
        self.store, self.launcher, self.steps, self.grace_s = store, launcher, steps, grace_s
        self.after_claim, self.nodes, self.run_as = after_claim, nodes, run_as
        self._ended: set[int] = set()  # cancelled jobs known to have no process left

    def resources(self, job: Job) -> Resources:
        """A foreground job's GPUs over ``nodes`` machines; a background job's on one."""
        return resources_for(job, self.nodes)

    def start(self, job: Job, reason: str, guests: Sequence[Job] = ()) -> bool:
        """Claim the job (PENDING → STARTING) and its guests, then launch; False if someone else moved it.

        A job whose GPUs do not split over the nodes (submitted before a restart with another ``--nodes``)
        fails with the reason instead.
        """
        try:
            resources = self.resources(job)
            account = self.run_as.account(job.owner)
        except DeeppoolError as err:
            self.store.transition(job.id, JobStatus.FAILED, str(err))
            return False
        if not self.store.transition(job.id, JobStatus.STARTING, reason):
            return False
        claimed = [g for g in guests
                   if self.store.transition(g.id, JobStatus.STARTING, f"lent the idle windows of job {job.id}",
                                            host_id=job.id)]
        if self.after_claim is not None:
            self.after_claim(job)
        attempt = self.store.attempts(job.id)
        self._launch(job, attempt, claimed, resources, account)
        return True

    def _launch(self, job: Job, attempt: int, guests: Sequence[Job], resources: Resources,
                account: Account | None) -> None:
        self.launcher.launch(job.id, attempt, self.steps(job, attempt, guests), resources=resources, account=account,
                             workdir=self.launcher.folder / f"job-{job.id}")

    def _owner_uid(self, job: Job) -> int | None:
        """The uid a job's files must have to be read (None: the server's own)."""
        try:
            account = self.run_as.account(job.owner)
        except DeeppoolError:
            return -1  # its account is gone: nothing it wrote is read
        return None if account is None else account.uid

    def lingering(self) -> set[int]:
        """Cancelled jobs not yet known to have no process left: they hold their GPUs until then."""
        return {job.id for job in self.store.jobs(states=(JobStatus.CANCELLED,)) if job.id not in self._ended}

    def requeue(self, job: Job, reason: str) -> None:
        """Preempt a running job: stop its attempt and put it back in the queue (not failed)."""
        if self.store.transition(job.id, JobStatus.PENDING, reason):
            self.launcher.stop(job.id, self.store.attempts(job.id), self.grace_s)

    def reconcile(self, now: datetime | None = None) -> None:
        now = now or datetime.now(UTC)
        for job in self.store.jobs(states=(JobStatus.STARTING, JobStatus.RUNNING)):
            if job.host_id is None:
                self._settle(job, now)
        for guest in self.store.jobs(states=(JobStatus.STARTING, JobStatus.RUNNING)):
            if guest.host_id is not None:
                self._settle_guest(guest)
        for job in self.store.jobs(states=(JobStatus.CANCELLED,)):
            if job.id in self._ended:
                continue
            attempt = self.store.attempts(job.id)
            if attempt:
                self.launcher.stop(job.id, attempt, self.grace_s)  # launched but not started yet: never will be
            if not attempt or not self.launcher.alive(job.id, attempt):
                self._ended.add(job.id)

    def _settle(self, job: Job, now: datetime) -> None:
        attempt = self.store.attempts(job.id)
        seen = self.launcher.observe(job.id, attempt)
        if seen.phase in (Phase.RUNNING, Phase.EXITED) and job.state is JobStatus.RUNNING:
            self._relay(job, attempt)
        if seen.phase is Phase.EXITED:
            if job.state is JobStatus.STARTING:  # it ran and ended between two looks
                self.store.transition(job.id, JobStatus.RUNNING, f"attempt {attempt} ran")
                self._relay(job, attempt)
            ok = seen.exit_code == 0
            self.store.transition(job.id, JobStatus.SUCCEEDED if ok else JobStatus.FAILED,
                                  "finished" if ok else f"exited with code {seen.exit_code}", exit_code=seen.exit_code)
        elif seen.phase is Phase.RUNNING and job.state is JobStatus.STARTING:
            self.store.transition(job.id, JobStatus.RUNNING, f"attempt {attempt} running")
        elif seen.phase is Phase.LOST:
            self.store.transition(job.id, JobStatus.FAILED, f"lost: attempt {attempt}'s supervisor ended without an "
                                                            "exit code")
        elif seen.phase is Phase.NOT_STARTED and now - job.updated_at > timedelta(seconds=self.grace_s):
            guests = self.store.jobs(states=(JobStatus.STARTING,), host_id=job.id)
            try:
                account = self.run_as.account(job.owner)
            except DeeppoolError as err:
                self.store.transition(job.id, JobStatus.FAILED, str(err))
                return
            self._launch(job, attempt, guests, self.resources(job), account)

    def _relay(self, job: Job, attempt: int) -> None:
        """The run's own events so far (stragglers, a policy's actions) into the job's event log."""
        folder, owner = self.launcher.files(job.id, attempt).folder, self._owner_uid(job)
        self.store.note(job.id, run_events(folder, job.id, owner), prefix=f"attempt {attempt}: ")
        progress = run_progress(folder, job.id, owner)
        if progress is not None and progress != job.progress:
            self.store.set_progress(job.id, progress)

    def _settle_guest(self, guest: Job) -> None:
        host = self.store.job(guest.host_id)
        assert host is not None
        if host.state is JobStatus.RUNNING and guest.state is JobStatus.STARTING:
            self.store.transition(guest.id, JobStatus.RUNNING, f"training in the idle windows of job {host.id}")
        elif host.state.terminal or host.state is JobStatus.PENDING:
            steps = guest_steps(self.launcher.files(host.id, self.store.attempts(host.id)).folder, host.id,
                                self._owner_uid(host))
            if host.state is JobStatus.SUCCEEDED and steps > 0:
                self.store.set_progress(guest.id, steps / max(1, guest.steps))
                self.store.transition(guest.id, JobStatus.SUCCEEDED, f"trained {steps} steps in job {host.id}'s "
                                                                     "idle windows", exit_code=0)
            else:
                self.store.transition(guest.id, JobStatus.PENDING, f"job {host.id} ended ({host.state.value}) "
                                                                   f"after {steps} background steps: requeued")


def _job_text(path: Path, owner: int | None) -> str:
    """A file the job wrote (see :func:`read_job_file`); OSError when there is none it may show."""
    data = read_job_file(path, owner)
    if data is None:
        raise OSError(f"'{path}' is not a file of the job's own")
    return data.decode(errors="replace")


def run_progress(folder: Path, job_id: int, owner: int | None = None) -> float | None:
    """Steps done over steps asked, from the job's run's ``progress.json`` (None before the first step).

    ``owner``: the uid the job runs as (None: this server's), for this and the readers below.
    """
    try:
        data = json.loads(_job_text(folder / f"job-{job_id}" / "run" / PROGRESS, owner))
        return min(1.0, int(data["steps_done"]) / max(1, int(data["steps"])))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run_events(folder: Path, job_id: int, owner: int | None = None) -> list[str]:
    """The messages of the job's run's ``events.jsonl`` (complete lines only; none when there is no file)."""
    try:
        text = _job_text(folder / f"job-{job_id}" / "run" / EVENTS, owner)
    except OSError:
        return []
    messages = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break  # the run is still writing it
        try:
            messages.append(str(json.loads(line)["message"]))
        except (ValueError, KeyError, TypeError):
            messages.append(line.strip())
    return messages


def guest_steps(folder: Path, host_id: int, owner: int | None = None) -> int:
    """Background steps the host's run reports (its ``summary.json``), 0 when there is none."""
    try:
        summary = json.loads(_job_text(folder / f"job-{host_id}" / "summary.json", owner))
        return int(summary["multiplex"]["bg_steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0
