"""Lending the idle ranks of running foreground jobs to background jobs, at any tick.

Every tick, each running foreground job that takes guests while it runs (one
started without a guest, on one node, with no script of its own: its driver
watches ``job-N.A.guests.json``, :mod:`deeppool.multiplex.guests`) offers
the ranks its Plan leaves idle (``job-N/plan.json``; the same rule as the
simulator's, :func:`~deeppool.scheduling.slots.lendable_slots`) that no guest
holds: the snapshot's ``free_slots``. The policy's
:class:`~deeppool.scheduling.Lend` decisions are applied here: the guest is
claimed (PENDING → STARTING, ``host_id`` set), its own folder made, and the
host attempt's control file written with its loan (the guest's model, batch,
steps per replica, folder and the allowed roots). The host's ranks pick it
up at their next step boundary.

The control file is the record of which ranks each guest holds, and it is
kept in step with the database every tick: a loan whose guest is no longer
live on that host (cancelled, preempted, done) is taken out, and the host's
ranks stop its process (it saves a checkpoint) while the host trains on.

A guest's progress and end come from its replicas' reports in the host's run
folder (``job-N/run/guests/job-M.rank-R.json``): every replica ``finished``
(its steps done): SUCCEEDED; one ``failed``: FAILED, with why. When its host
ends, stops, or starts another attempt (a resize: its guests are released,
never carried over), a guest not finished goes back to the queue, its
checkpoints in its own folder, and resumes from them when lent again.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from deeppool.coordinator.isolation import RunAs, private_dir, write_private
from deeppool.coordinator.jobs import Job, JobKind, JobStatus
from deeppool.coordinator.launcher import Launcher
from deeppool.coordinator.store import Store
from deeppool.errors import DeeppoolError
from deeppool.multiplex.guests import GuestLoan, GuestReport, GuestState, loans_json, parse_loans, report_path
from deeppool.planner.profiling.interference import InterferenceModel
from deeppool.plans import Plan
from deeppool.scheduling import Slot
from deeppool.scheduling.slots import lendable_slots

log = logging.getLogger("deeppool.coordinator")

LIVE = (JobStatus.STARTING, JobStatus.RUNNING)
Reader = Callable[[Path, Job], object]
"""Reads a JSON file a job wrote, as the job's account must own it (:func:`~deeppool.coordinator.runtime.read_json`)."""


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """What a guest's replicas say: every one finished, one failed (why), and the steps they hold."""

    finished: bool
    failed: str | None
    steps: int


class Lending:
    """The loans of running hosts (see the module's docstring)."""

    def __init__(self, store: Store, launcher: Launcher, read: Reader, *, run_as: RunAs | None = None,
                 allowed_roots: tuple[Path, ...] = (), nodes: int = 1, model: InterferenceModel | None = None) -> None:
        """``model``: which ranks are worth lending (the simulator's default interference model unless given)."""
        self.store, self.launcher, self.read, self.run_as = store, launcher, read, run_as or RunAs()
        self.allowed_roots, self.nodes, self.model = allowed_roots, nodes, model or InterferenceModel()
        self._slots: dict[tuple[int, int], list[Slot]] = {}  # (host, attempt) -> its Plan's lendable ranks

    # -- what hosts offer --------------------------------------------------------------------------------------
    def takes_guests(self, host: Job) -> bool:
        """Whether ``host``'s runs take guests while they run (and so get none at their start)."""
        return host.kind is JobKind.FOREGROUND and host.script is None and self.nodes == 1

    def joins(self, host: Job, guest: Job) -> bool:
        """Whether ``guest`` may join ``host`` while it runs: its processes are started by the host's ranks, so
        its jobs must run as the host's account."""
        return self.takes_guests(host) and self.run_as.same_account(host.owner, guest.owner)

    def free_slots(self, jobs: Sequence[Job]) -> list[Slot]:
        """The idle ranks of running hosts that no guest holds, from their Plans."""
        free: list[Slot] = []
        hosts = [host for host in jobs
                 if host.state is JobStatus.RUNNING and host.host_id is None and self.takes_guests(host)]
        self._slots = {key: slots for key, slots in self._slots.items() if key[0] in {host.id for host in hosts}}
        for host in hosts:
            attempt = self.store.attempts(host.id)
            loans = self.loans(host.id, attempt)
            if any(guest.id not in loans for guest in self.store.jobs(states=LIVE, host_id=host.id)):
                continue  # a guest given at its start holds every idle rank
            held = {rank for loan in loans.values() for rank in loan.ranks}
            free += [slot for slot in self._plan_slots(host, attempt) if slot.rank not in held]
        return free

    def _plan_slots(self, host: Job, attempt: int) -> list[Slot]:
        key = (host.id, attempt)
        if key not in self._slots:
            data = self.read(self.launcher.folder / f"job-{host.id}" / "plan.json", host)
            try:
                plan = Plan.from_json(data, where=f"job {host.id}'s plan")
            except (DeeppoolError, ValueError, KeyError, TypeError):
                return []  # not written yet (it is planning), or not a plan: nothing to lend now
            if (plan.gpus, plan.global_batch) != (host.held, host.current_batch):
                return []  # an earlier attempt's plan (another width or batch): this one has not planned yet
            windows = [tuple(w.length_ms for w in plan.idle_windows(rank)) for rank in range(plan.gpus)]
            iteration_ms = plan.predicted.iteration_ms
            idle = [min(1.0, max(0.0, sum(w) / iteration_ms)) if iteration_ms > 0 else 0.0 for w in windows]
            self._slots[key] = lendable_slots(host.id, idle, lambda rank: windows[rank], iteration_ms, self.model)
        return self._slots[key]

    # -- loans -------------------------------------------------------------------------------------------------
    def control(self, host_id: int, attempt: int) -> Path:
        return self.launcher.files(host_id, attempt).guests_control

    def loans(self, host_id: int, attempt: int) -> dict[int, GuestLoan]:
        """The loans in the host attempt's control file (the server's own record; none when there is none)."""
        try:
            data = self.control(host_id, attempt).read_bytes()
        except FileNotFoundError:
            return {}
        return parse_loans(data) or {}

    def _write(self, host: Job, attempt: int, loans: Sequence[GuestLoan]) -> None:
        account = self.run_as.account(host.owner)
        write_private(self.control(host.id, attempt), loans_json(loans), account)

    def lend(self, guest: Job, host: Job, ranks: tuple[int, ...], reason: str) -> bool:
        """Claim ``guest`` for ``ranks`` of running ``host`` and write its loan; whether it was claimed."""
        attempt = self.store.attempts(host.id)
        try:
            account = self.run_as.account(guest.owner)
        except DeeppoolError:
            return False  # its account is gone: it waits (its own start says why)
        if not self.store.transition(guest.id, JobStatus.STARTING, reason, host_id=host.id):
            return False
        folder = self.launcher.folder / f"job-{guest.id}"
        private_dir(folder, account)
        loan = GuestLoan(job_id=guest.id, ranks=ranks, model=guest.model, batch=guest.batch,
                         steps=math.ceil(guest.steps / len(ranks)), folder=folder, roots=self.allowed_roots)
        self._write(host, attempt, [*self.loans(host.id, attempt).values(), loan])
        return True

    def sync(self, hosts: Sequence[Job]) -> None:
        """Take out of each live host's control file the loans whose guest is no longer live on it."""
        for host in hosts:
            if host.state not in LIVE or host.host_id is not None or not self.takes_guests(host):
                continue
            attempt = self.store.attempts(host.id)
            loans = self.loans(host.id, attempt)
            if not loans:
                continue
            live = {g.id for g in self.store.jobs(states=LIVE, host_id=host.id)}
            kept = [loan for job_id, loan in loans.items() if job_id in live]
            if len(kept) < len(loans):
                self._write(host, attempt, kept)

    # -- guests' ends ------------------------------------------------------------------------------------------
    def lent_in(self, guest: Job, host: Job) -> int | None:
        """The attempt of ``host`` whose control file lends ``guest`` (its latest), or None: a guest given at the
        host's start."""
        attempts = range(self.store.attempts(host.id), 0, -1)
        return next((attempt for attempt in attempts if guest.id in self.loans(host.id, attempt)), None)

    def outcome(self, guest: Job, host: Job, attempt: int) -> Outcome:
        loan = self.loans(host.id, attempt).get(guest.id)
        ranks = loan.ranks if loan is not None else ()
        run = self.launcher.folder / f"job-{host.id}" / "run"
        reports = [GuestReport.parse(guest.id, rank, self.read(report_path(run, guest.id, rank), host))
                   for rank in ranks]
        seen = [r for r in reports if r is not None]
        failed = next((f"rank {r.rank} of job {host.id}: {r.error or 'failed'}" for r in seen
                       if r.state is GuestState.FAILED), None)
        finished = bool(ranks) and len(seen) == len(ranks) and all(r.state is GuestState.FINISHED for r in seen)
        return Outcome(finished=finished, failed=failed, steps=sum(r.steps for r in seen))

    def settle(self, guest: Job, host: Job) -> bool:
        """Move a guest lent while its host ran as its replicas' reports and its host say; False when ``guest``
        was given at its host's start (the caller settles it)."""
        attempt = self.lent_in(guest, host)
        if attempt is None:
            return False
        seen = self.outcome(guest, host, attempt)
        if seen.steps and min(1.0, seen.steps / max(1, guest.steps)) != guest.progress:
            self.store.set_progress(guest.id, seen.steps / max(1, guest.steps))
        current = host.state is JobStatus.RUNNING and attempt == self.store.attempts(host.id)
        if seen.finished:
            self.store.transition(guest.id, JobStatus.SUCCEEDED, f"trained {seen.steps} steps in job {host.id}'s "
                                                                 "idle windows", exit_code=0)
        elif seen.failed is not None:
            self.store.transition(guest.id, JobStatus.FAILED, f"its background process failed on {seen.failed}")
        elif current and guest.state is JobStatus.STARTING:
            self.store.transition(guest.id, JobStatus.RUNNING, f"training in the idle windows of job {host.id}")
        elif not current:
            why = "was resized: its guests are released" if host.state in LIVE else f"ended ({host.state.value})"
            self.store.transition(guest.id, JobStatus.PENDING, f"job {host.id} {why} after {seen.steps} background "
                                                               "steps: requeued, to resume from its checkpoint")
        return True
