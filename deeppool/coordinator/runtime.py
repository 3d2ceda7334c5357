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
* a fact the server cannot read now (no descriptors, no memory:
  :class:`~deeppool.coordinator.isolation.ServerShortage`): the tick fails and
  is retried; nothing is decided from it (never "lost", never "no account");
* no supervisor ever took the attempt's lock, ``grace_s`` after the job
  became STARTING: the coordinator died between its commit and the launch, so
  it launches now. The supervisor's lock file makes a second launch of the
  same attempt a no-op, so nothing runs twice.

Jobs CANCELLED while running are stopped (SIGTERM, grace, then every
process of the attempt killed); until their last process is gone they still
hold their GPUs (:meth:`Runtime.lingering`); then the database marks them
settled (:meth:`~deeppool.coordinator.store.Store.settle`), and no later tick reads them. One cancelled after its launch
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

Everything a job writes is read defensively (:func:`read_json`): at most
:data:`MAX_FILE_BYTES` of a file, any JSON at all (1e400, NaN, nesting,
wrong types) gives "nothing reported", never an exception. A job is held to
:class:`JobLimits`: its first ``max_events`` run events are relayed (the last
says that later ones are not), and a job whose log passes ``max_log_bytes``
is stopped (FAILED, with the reason), and its log ends with a line saying so.

A background job lent a foreground job's idle windows (a *guest*) has no
supervisor of its own. When it runs as its host's account, its processes are
started by its host's ranks; when it runs as another account, by its host's
supervisor, as the guest's account, in a cgroup nested in its host's
(:mod:`deeppool.coordinator.guest`; the local launcher as root only, else a
guest is lent only to a host of its own account). It becomes RUNNING with its
host, and when the host ends it SUCCEEDED if it trained (the host's
``summary.json`` counts its steps, and the reason gives the host's measured
slowdown), else it goes back to the queue. A guest lent while its host runs
(:attr:`Runtime.lending`, :mod:`deeppool.coordinator.lending`; one of another
account through a broker its host's supervisor starts then,
:mod:`deeppool.coordinator.lent_brokers`) is settled from its replicas'
reports instead (one of another account, from its own replicas' files):
SUCCEEDED once it trained its steps, FAILED when its process failed,
requeued when its host ends or stops first.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from deeppool.coordinator.guest import GuestSpec
from deeppool.coordinator.isolation import REFUSALS, REFUSED, Account, AccountError, RunAs, read_job_file
from deeppool.coordinator.jobs import Job, JobStatus
from deeppool.coordinator.launcher import Launcher, LaunchPhase, Resources, resources_for
from deeppool.coordinator.lending import Lending
from deeppool.coordinator.store import Store
from deeppool.executor.training.outputs import EVENTS, PROGRESS
from deeppool.errors import DeeppoolError

log = logging.getLogger("deeppool.coordinator")

Steps = Callable[[Job, int, Sequence[Job]], list[list[str]]]
"""A job's steps for an attempt, given the guests lent its idle windows."""

MAX_FILE_BYTES = 1 << 20
"""The most the coordinator reads of a file a job wrote (progress, summary, run events)."""
MAX_MESSAGE = 500
"""A run event's message is cut to this many characters."""
LOG_CAP_SLACK = 64 << 10
"""The server stops a job whose log passed its cap by more than this (its supervisor stops it at the cap; this
is for a supervisor that does not, under Slurm say)."""
EXIT_CODES = range(-255, 256)
"""Exit codes the supervisor can report (negative: killed by that signal); anything else is a damaged file."""


@dataclass(frozen=True, kw_only=True)
class JobLimits:
    """What one job may make the coordinator keep (``serve --max-events``, ``--max-log-mb``)."""

    max_events: int = 1000
    """run events relayed into the job's event log per attempt; the last one says later ones were cut"""
    max_log_bytes: int = 1 << 30
    """past this, the job is stopped and its log ends with a line saying so"""


class Runtime:
    def __init__(self, store: Store, launcher: Launcher, steps: Steps, *, grace_s: float = 5.0,
                 after_claim: Callable[[Job], None] | None = None, nodes: int = 1, run_as: RunAs = RunAs(),
                 limits: JobLimits = JobLimits(), allowed_roots: tuple[Path, ...] = ()) -> None:
        """``after_claim`` runs between the claim's commit and the launch: a fault-injection point for tests.

        ``nodes``: the machines each foreground job spans; ``run_as``: the account each job runs as;
        ``allowed_roots``: where a guest of another account may take its model file from (checked at launch).
        """
        self.store, self.launcher, self.steps, self.grace_s = store, launcher, steps, grace_s
        self.after_claim, self.nodes, self.run_as, self.limits = after_claim, nodes, run_as, limits
        self.allowed_roots = allowed_roots
        self._ended: set[int] = set()  # cancelled jobs known to have no process left
        self.lending = Lending(store, launcher, lambda path, job: read_json(path, self._owner_uid(job)),
                               run_as=run_as, allowed_roots=allowed_roots, nodes=nodes)
        """the loans of running hosts' idle ranks (:mod:`deeppool.coordinator.lending`)"""

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
            self.store.transition(job.id, JobStatus.FAILED, _public(err, job))
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

    def can_host(self, host: Job, guest: Job) -> bool:
        """Whether ``guest`` may be lent ``host``'s idle windows: its jobs run as the host's account, or the
        launcher can start it as its own (:mod:`deeppool.coordinator.guest`)."""
        return self.run_as.same_account(host.owner, guest.owner) or self.launcher.brokers_guests

    def _launch(self, job: Job, attempt: int, guests: Sequence[Job], resources: Resources,
                account: Account | None) -> None:
        self.launcher.launch(job.id, attempt, self.steps(job, attempt, guests), resources=resources, account=account,
                             workdir=self.launcher.folder / f"job-{job.id}", guest=self._guest(job, guests))

    def _guest(self, host: Job, guests: Sequence[Job]) -> GuestSpec | None:
        """The first guest, when it runs as another account than its host: what the host's broker starts."""
        if not guests or self.run_as.same_account(host.owner, guests[0].owner):
            return None
        guest = guests[0]
        try:
            account = self.run_as.account(guest.owner)
        except DeeppoolError:
            return None  # its account is gone: the host finds no broker, and runs alone
        assert account is not None  # two owners' accounts differ only when each job has one
        return GuestSpec(job_id=guest.id, account=account, folder=self.launcher.folder / f"job-{guest.id}",
                         log=self.launcher.files(guest.id, 1).log, model=guest.model, batch=guest.batch,
                         roots=self.allowed_roots, ranks=host.held)

    def _owner_uid(self, job: Job) -> int | None:
        """The uid a job's files must have to be read (None: the server's own)."""
        try:
            account = self.run_as.account(job.owner)
        except DeeppoolError:
            return -1  # its account is gone: nothing it wrote is read
        return None if account is None else account.uid

    def job_file(self, job: Job, name: str) -> bytes | None:
        """A file the job wrote (``name``, relative to its folder), read as :func:`read_json` reads one: None when it
        is missing, not the job's own, or past :data:`MAX_FILE_BYTES` (its first bytes are given then)."""
        return read_job_file(self.launcher.folder / f"job-{job.id}" / name, self._owner_uid(job), MAX_FILE_BYTES)

    def job_json(self, job: Job, name: str) -> Any:
        """A JSON file the job wrote (``name``, relative to its folder), or None (:func:`read_json`)."""
        return read_json(self.launcher.folder / f"job-{job.id}" / name, self._owner_uid(job))

    def relaunch(self, job: Job, reason: str) -> bool:
        """Start the next attempt of a running job whose attempt ended resumably (a resize): RUNNING → STARTING,
        then launch on the shape the store holds for it now; False if it was not running."""
        if not self.store.transition(job.id, JobStatus.STARTING, reason):
            return False
        current = self.store.job(job.id)
        assert current is not None
        try:
            resources, account = self.resources(current), self.run_as.account(current.owner)
        except DeeppoolError as err:
            self.store.transition(job.id, JobStatus.FAILED, _public(err, job))
            return False
        self._launch(current, self.store.attempts(job.id), [], resources, account)
        return True

    def lingering(self) -> set[int]:
        """Cancelled jobs not yet known to have no process left: they hold their GPUs until then."""
        return {job.id for job in self.store.unsettled() if job.id not in self._ended}

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
        for job in self.store.unsettled():  # not the history: only those not yet known to have ended
            if job.id in self._ended:
                continue
            attempt = self.store.attempts(job.id)
            if attempt:
                self.launcher.stop(job.id, attempt, self.grace_s)  # launched but not started yet: never will be
            if not attempt or not self.launcher.alive(job.id, attempt):
                self._ended.add(job.id)
                self.store.settle(job.id)

    def _settle(self, job: Job, now: datetime) -> None:
        attempt = self.store.attempts(job.id)
        seen = self.launcher.observe(job.id, attempt)
        if seen.phase in (LaunchPhase.RUNNING, LaunchPhase.EXITED) and job.state is JobStatus.RUNNING:
            self._relay(job, attempt)
        if seen.phase is LaunchPhase.RUNNING and job.state is JobStatus.RUNNING and self._over_log_cap(job, attempt):
            return
        if seen.phase in (LaunchPhase.EXITED, LaunchPhase.LOST) and self.store.resizing(job.id):
            return  # an attempt that ended in the middle of a resize: the resize's to settle (elastic.py)
        if seen.phase is LaunchPhase.EXITED:
            if job.state is JobStatus.STARTING:  # it ran and ended between two looks
                self.store.transition(job.id, JobStatus.RUNNING, f"attempt {attempt} ran")
                self._relay(job, attempt)
            code = seen.exit_code if seen.exit_code in EXIT_CODES else None
            stopped = self.launcher.files(job.id, attempt).stopped_reason()  # the supervisor's own: its log cap
            ok = code == 0 and stopped is None
            self.store.transition(job.id, JobStatus.SUCCEEDED if ok else JobStatus.FAILED,
                                  "finished" if ok else stopped or self._failure(job, code), exit_code=code)
        elif seen.phase is LaunchPhase.RUNNING and job.state is JobStatus.STARTING:
            self.store.transition(job.id, JobStatus.RUNNING, f"attempt {attempt} running")
        elif seen.phase is LaunchPhase.LOST:
            self.store.transition(job.id, JobStatus.FAILED, f"lost: attempt {attempt}'s supervisor ended without an "
                                                            "exit code")
        elif seen.phase is LaunchPhase.NOT_STARTED and now - job.updated_at > timedelta(seconds=self.grace_s):
            guests = self.store.jobs(states=(JobStatus.STARTING,), host_id=job.id)
            try:
                account = self.run_as.account(job.owner)
            except DeeppoolError as err:
                self.store.transition(job.id, JobStatus.FAILED, _public(err, job))
                return
            self._launch(job, attempt, guests, self.resources(job), account)

    def _relay(self, job: Job, attempt: int) -> None:
        """The run's own events so far (stragglers, a policy's actions) into the job's event log."""
        folder, owner = self.launcher.files(job.id, attempt).folder, self._owner_uid(job)
        self.store.note(job.id, capped(run_events(folder, job.id, owner), self.limits.max_events),
                        prefix=f"attempt {attempt}: ")
        progress = run_progress(folder, job.id, owner)
        if progress is not None and progress != job.progress:
            self.store.set_progress(job.id, progress)

    def _failure(self, job: Job, code: int | None) -> str:
        """A failed attempt's reason: its exit code, and why its model was refused at launch if it was."""
        if code is None:
            return "its exit file is damaged"
        refused = read_json(self.launcher.folder / f"job-{job.id}" / REFUSED, self._owner_uid(job))
        key = refused.get("why") if isinstance(refused, dict) else None
        why = REFUSALS.get(key) if isinstance(key, str) else None
        return f"{why} (exited with code {code})" if why else f"exited with code {code}"

    def _over_log_cap(self, job: Job, attempt: int) -> bool:
        """A job whose log passed its cap is stopped, and its log ends with a line saying so: whether it was."""
        log = self.launcher.files(job.id, attempt).log
        try:
            size = log.stat().st_size
        except OSError:
            return False
        if size <= self.limits.max_log_bytes + LOG_CAP_SLACK:  # the supervisor's cap comes first
            return False
        reason = f"its log passed the cap of {self.limits.max_log_bytes} bytes (serve --max-log-mb): stopped"
        if not self.store.transition(job.id, JobStatus.FAILED, reason):
            return False
        self.launcher.stop(job.id, attempt, self.grace_s)
        with log.open("a") as out:  # after the stop: the notice is the log's last line
            out.write(f"\ndeeppool: this job's log passed the cap of {self.limits.max_log_bytes} bytes: "
                      "the job was stopped\n")
        return True

    def _settle_guest(self, guest: Job) -> None:
        host = self.store.job(guest.host_id)
        assert host is not None
        if self.lending.settle(guest, host):  # lent while its host ran
            return
        if host.state is JobStatus.RUNNING and guest.state is JobStatus.STARTING:
            self.store.transition(guest.id, JobStatus.RUNNING, f"training in the idle windows of job {host.id}")
        elif host.state.terminal or host.state is JobStatus.PENDING:
            steps, slowdown = guest_steps(self.launcher.files(host.id, self.store.attempts(host.id)).folder,
                                          host.id, self._owner_uid(host))
            if host.state is JobStatus.SUCCEEDED and steps > 0:
                self.store.set_progress(guest.id, steps / max(1, guest.steps))
                cost = f" (its measured slowdown: {100 * slowdown:+.1f}%)" if slowdown is not None else ""
                self.store.transition(guest.id, JobStatus.SUCCEEDED, f"trained {steps} steps in job {host.id}'s "
                                                                     f"idle windows{cost}", exit_code=0)
            else:
                self.store.transition(guest.id, JobStatus.PENDING, f"job {host.id} ended ({host.state.value}) "
                                                                   f"after {steps} background steps: requeued")


def read_json(path: Path, owner: int | None = None) -> Any:
    """A job's JSON file, or None when it is missing, not the job's own (see
    :func:`~deeppool.coordinator.isolation.read_job_file`), too big, or not JSON that Python can hold (never
    raises). ``owner``: the uid the job runs as (None: this server's), for this and the readers below."""
    data = read_job_file(path, owner, MAX_FILE_BYTES + 1)
    if data is None or len(data) > MAX_FILE_BYTES:
        return None
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def count(value: Any) -> float | None:
    """A finite, non-negative number a job reported (not a bool, NaN, 1e400 or a string), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value) if isinstance(value, float) or abs(value) < 1 << 1000 else math.inf
    return number if math.isfinite(number) and number >= 0 else None


def run_progress(folder: Path, job_id: int, owner: int | None = None) -> float | None:
    """Steps done over steps asked, from the job's run's ``progress.json`` (None before the first step,
    or when what the job wrote is not two finite counts)."""
    data = read_json(folder / f"job-{job_id}" / "run" / PROGRESS, owner)
    if not isinstance(data, dict):
        return None
    done, asked = count(data.get("steps_done")), count(data.get("steps"))
    if done is None or asked is None:
        return None
    return min(1.0, done / max(1.0, asked))


def run_events(folder: Path, job_id: int, owner: int | None = None) -> list[str]:
    """The messages of the job's run's ``events.jsonl`` (complete lines of its first :data:`MAX_FILE_BYTES`;
    none when there is no file of the job's own), each cut to :data:`MAX_MESSAGE` characters."""
    data = read_job_file(folder / f"job-{job_id}" / "run" / EVENTS, owner, MAX_FILE_BYTES)
    if data is None:
        return []
    text = data.decode(errors="replace")
    messages = []
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break  # the run is still writing it
        try:
            message = json.loads(line)["message"]
        except (ValueError, KeyError, TypeError, IndexError, RecursionError):
            message = None
        shown = message if isinstance(message, str) else line.strip()
        messages.append(shown[:MAX_MESSAGE].encode(errors="replace").decode())  # a lone surrogate cannot be stored
    return messages


def _public(err: DeeppoolError, job: Job) -> str:
    """A reason the public status page may show: an account error names the owner's account, so it goes to
    the server's log and the job says only what is wrong."""
    if not isinstance(err, AccountError):
        return str(err)
    log.warning("job %d cannot start: %s", job.id, err)
    return "its owner has no OS account jobs may run as: the operator creates one (docs/coordinator.md)"


def capped(messages: list[str], limit: int) -> list[str]:
    """Fewer than ``limit`` messages as they are; from ``limit`` on, the first ``limit - 1`` and a last one
    saying the rest were cut (so the list a job's file gives is always a prefix of the next, as
    :meth:`Store.note` needs: with exactly ``limit`` kept as they were, the notice of the next could never
    be stored)."""
    if len(messages) < limit:
        return messages
    return [*messages[:limit - 1], f"later events are not recorded: a job keeps at most {limit} "
                                   "(serve --max-events)"]


def guest_steps(folder: Path, host_id: int, owner: int | None = None) -> tuple[int, float | None]:
    """Background steps the host's run reports (its ``summary.json``), 0 when there is none or it is damaged;
    and the host's measured slowdown (a finite fraction, else None)."""
    summary = read_json(folder / f"job-{host_id}" / "summary.json", owner)
    multiplex = summary.get("multiplex") if isinstance(summary, dict) else None
    if not isinstance(multiplex, dict):
        return 0, None
    steps, slowdown = count(multiplex.get("bg_steps")), multiplex.get("fg_slowdown")
    finite = isinstance(slowdown, float | int) and not isinstance(slowdown, bool) and math.isfinite(slowdown) \
        and abs(slowdown) < 1e6
    return (int(min(steps, 1 << 62)) if steps is not None else 0), (float(slowdown) if finite else None)
