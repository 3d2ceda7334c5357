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

A guest of another account (``serve --job-user submitter``, where the
launcher can start a process as another account: the local launcher as root,
with cgroups) joins the same way, through a broker of its own: the server
first names it in the host attempt's brokers file (the server's, which the
host cannot change; :mod:`deeppool.coordinator.lent_brokers`), whose
supervisor starts its broker, then writes its loan naming the broker's
socket; the host's ranks ask that broker for their replicas, which run as the
guest's account. Its loan, as the server records it, is the brokers file's.

The control file is the record of which ranks each guest holds, and it is
kept in step with the database every tick: a loan whose guest is no longer
live on that host (cancelled, preempted, done) is taken out (and its broker
retired), and the host's ranks stop its process (it saves a checkpoint)
while the host trains on.

A guest's progress and end come from its replicas' reports in the host's run
folder (``job-N/run/guests/job-M.rank-R.json``): every replica ``finished``
(its steps done): SUCCEEDED; one ``failed``: FAILED, with why. The steps of a
guest of another account come from its own replicas instead, never from its
host: each says how far it is in the guest's folder
(:func:`~deeppool.coordinator.guest.replica_progress`, read as the guest's
file), and every replica at its steps: SUCCEEDED. When its host
ends, stops, or starts another attempt (a resize: its guests are released,
never carried over), a guest not finished goes back to the queue, its
checkpoints in its own folder, and resumes from them when lent again.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from deeppool.coordinator.guest import GuestSpec, replica_progress
from deeppool.coordinator.isolation import Account, RunAs, private_dir, replace_private
from deeppool.coordinator.jobs import Job, JobKind, JobStatus
from deeppool.coordinator.launcher import Launcher
from deeppool.coordinator.lent_brokers import read_brokers, write_brokers
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
        """Whether ``guest`` may join ``host`` while it runs: its processes are started by the host's ranks (it
        runs as the host's account) or by a broker of its own (another account's, where the launcher can start
        a process as another account)."""
        return self.takes_guests(host) and (self.run_as.same_account(host.owner, guest.owner)
                                            or self.launcher.brokers_guests)

    def given_at_start(self, host: Job, guest: Job) -> bool:
        """Whether ``guest``, waiting when ``host`` starts, is given to it then (its processes start with the
        host's), rather than lent through the control file once the host has planned: a guest of another
        account (its broker set up with the host, its memory measured before the host's first step), or any
        guest of a host that takes none while it runs."""
        return not self.takes_guests(host) or not self.run_as.same_account(host.owner, guest.owner)

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
        replace_private(self.control(host.id, attempt), loans_json(loans), account)

    def brokered(self, host_id: int, attempt: int) -> dict[int, GuestSpec]:
        """The guests of other accounts lent the host attempt, as the server named them to its supervisor."""
        return read_brokers(self.launcher.files(host_id, attempt).guest_brokers)

    def lend(self, guest: Job, host: Job, ranks: tuple[int, ...], reason: str) -> bool:
        """Claim ``guest`` for ``ranks`` of running ``host`` and write its loan (a guest of another account is
        named in the brokers file first); whether it was claimed."""
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
        if account is not None and not self.run_as.same_account(host.owner, guest.owner):
            loan = self._broker(host, attempt, guest, account, loan)
        self._write(host, attempt, [*self.loans(host.id, attempt).values(), loan])
        return True

    def _broker(self, host: Job, attempt: int, guest: Job, account: Account, loan: GuestLoan) -> GuestLoan:
        """Name ``guest`` in the host attempt's brokers file (its supervisor starts its broker); its loan, naming
        the broker's socket."""
        files = self.launcher.files(host.id, attempt)
        spec = GuestSpec(job_id=guest.id, account=account, folder=loan.folder,
                         log=self.launcher.files(guest.id, 1).log, model=guest.model, batch=guest.batch,
                         roots=self.allowed_roots, ranks=host.held, lent=loan.ranks, steps=loan.steps)
        write_brokers(files.guest_brokers, {**self.brokered(host.id, attempt), guest.id: spec}.values())
        return replace(loan, broker=files.lent_socket(guest.id))

    def sync(self, hosts: Sequence[Job]) -> None:
        """Take out of each live host's control file (and brokers file) the loans whose guest is no longer live
        on it."""
        for host in hosts:
            if host.state not in LIVE or host.host_id is not None or not self.takes_guests(host):
                continue
            attempt = self.store.attempts(host.id)
            loans = self.loans(host.id, attempt)
            brokered = self.brokered(host.id, attempt) if self.launcher.brokers_guests else {}
            if not loans and not brokered:
                continue
            live = {g.id for g in self.store.jobs(states=LIVE, host_id=host.id)}
            kept = [loan for job_id, loan in loans.items() if job_id in live]
            if len(kept) < len(loans):
                self._write(host, attempt, kept)
            if set(brokered) - live:
                write_brokers(self.launcher.files(host.id, attempt).guest_brokers,
                              [spec for job_id, spec in brokered.items() if job_id in live])

    # -- guests' ends ------------------------------------------------------------------------------------------
    def _lent(self, guest: Job, host: Job, attempt: int) -> tuple[tuple[int, ...], int] | None:
        """The ranks and steps per replica ``host``'s attempt was lent ``guest`` for, as the server wrote them (for
        a guest of another account, its brokers file: the host cannot change it), or None."""
        if not self.run_as.same_account(host.owner, guest.owner):
            spec = self.brokered(host.id, attempt).get(guest.id)
            return None if spec is None else (spec.lent, spec.steps)
        loan = self.loans(host.id, attempt).get(guest.id)
        return None if loan is None else (loan.ranks, loan.steps)

    def lent_in(self, guest: Job, host: Job) -> int | None:
        """The attempt of ``host`` that lends ``guest`` (its latest), or None: a guest given at the host's start."""
        attempts = range(self.store.attempts(host.id), 0, -1)
        return next((attempt for attempt in attempts if self._lent(guest, host, attempt) is not None), None)

    def outcome(self, guest: Job, host: Job, attempt: int) -> Outcome:
        ranks, steps = self._lent(guest, host, attempt) or ((), 0)
        run = self.launcher.folder / f"job-{host.id}" / "run"
        reports = [GuestReport.parse(guest.id, rank, self.read(report_path(run, guest.id, rank), host))
                   for rank in ranks]
        seen = [r for r in reports if r is not None]
        failed = next((f"rank {r.rank} of job {host.id}: {r.error or 'failed'}" for r in seen
                       if r.state is GuestState.FAILED), None)
        if not self.run_as.same_account(host.owner, guest.owner):  # its steps are its own replicas' word
            own = [self._own_steps(guest, replica) for replica in range(len(ranks))]
            return Outcome(finished=bool(ranks) and all(done >= steps for done in own), failed=failed, steps=sum(own))
        finished = bool(ranks) and len(seen) == len(ranks) and all(r.state is GuestState.FINISHED for r in seen)
        return Outcome(finished=finished, failed=failed, steps=sum(r.steps for r in seen))

    def _own_steps(self, guest: Job, replica: int) -> int:
        """The steps replica ``replica`` of a guest of another account holds, as it says in its own folder."""
        path = replica_progress(self.launcher.folder / f"job-{guest.id}", replica)
        report = GuestReport.parse(guest.id, replica, self.read(path, guest))
        return 0 if report is None else report.steps

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
