"""Guests that join and leave a running foreground job: a control file the ranks watch, a report per guest.

A coordinator lends the idle ranks of a running foreground job (the *host*) to
background jobs (*guests*) at any tick. It writes the host attempt's control
file (:attr:`GuestsConfig.control`): the loans in force, each a
:class:`GuestLoan` naming the guest, the host's ranks it was lent, its model,
batch, the steps each of its replicas trains and its own folder. Every hosting
rank of the host runs a :class:`GuestLender` (the executor's
:class:`~deeppool.executor.engine.idle.IdleLender`), which looks at the file
at each step boundary (one ``stat``; the file is parsed again only when it
changed, and a file caught half-written is read at a later boundary):

* a loan that names this rank and is new: the guest's background process is
  started (``gate`` mode; its model staged and checked by the process itself,
  through :attr:`GuestsConfig.runner`; for a guest of another account, by the
  broker the loan names, as the guest's account, which the rank asks again at
  later boundaries while it does not answer yet, for :data:`BROKER_WAIT_S`,
  :mod:`~deeppool.multiplex.remote`), as one of its replicas (replica ``i``
  of a loan of ranks ``(r0, r1, ...)`` seeds and checkpoints as ``i``, in the
  guest's folder, so a guest that comes back resumes). It loads its model at
  normal priority (``idle_after_load``: a few seconds of the host's CPU, once)
  and is given no window until it has; then it trains under ``SCHED_IDLE``, in
  windows only. A guest that joins a running host is never waited for. One
  lent before the host's first step is waited for once, at its first shared
  step, for at most :data:`START_WAIT_S` (well within a collective's timeout),
  as a background given at the start is: else a short run would end before
  any guest had loaded;
* a loan that is gone (the guest was cancelled or preempted): its process is
  asked to quit (a checkpoint, its statistics), or killed when it has not
  loaded yet; the host trains on, never waiting for it (a thread of the rank
  waits, and writes its report; the host's end waits for those threads);
* a guest's process that ended by itself: it trained its steps (exit 0), or
  it failed.

Each replica's state is in ``OUT/guests/job-M.rank-R.json`` (a
:class:`GuestReport`): its process writes ``running`` and its step count as it
trains; the rank writes the last word when the replica ends: ``finished`` (its
steps are done), ``left`` (its loan was taken back), ``stopped`` (the host's
run ended first) or ``failed`` (with why). A guest's windows are gated by the
same :class:`~deeppool.multiplex.session.Session` (A/B blocks, slowdown
controller) as a background given at the start. On rank 0 the run's
``summary.json`` gets a ``guests`` list of every replica's last report.
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deeppool.errors import DeeppoolError
from deeppool.executor.engine.idle import IdleListener, IdleWindowEvent
from deeppool.multiplex.config import BackgroundConfig, MuxMode
from deeppool.multiplex.cpu import ProcessBackground, child_spec
from deeppool.multiplex.metrics import RankBackground
from deeppool.multiplex.remote import BrokerAbsent, BrokeredChild
from deeppool.multiplex.session import Session
from deeppool.planner.profiling.interference import idle_throughout

if TYPE_CHECKING:
    import torch
    from rich.console import Console

    from deeppool.executor.engine.comm import Comm
    from deeppool.executor.engine.timing import Span
    from deeppool.plans import Plan

GUESTS_KEY = "guests"
"""Where the :class:`GuestsConfig` is in the file every rank reads (:class:`~deeppool.executor.config.RankConfig`)."""
MAX_CONTROL_BYTES = 1 << 20
"""The most read of a control file."""
START_WAIT_S = 20.0
"""The longest a host waits for a guest lent before its first step to load (once, at its first shared step)."""
BROKER_WAIT_S = 30.0
"""The longest a rank keeps asking, at its step boundaries, for a lent guest's broker (its host's supervisor
starts it within a tenth of a second of the server's word) before it reports the guest failed."""


@dataclass(frozen=True, kw_only=True)
class GuestsConfig:
    """Where a host's ranks find their loans, and what starts a guest's process."""

    control: Path
    """the control file the coordinator writes (the loans in force)"""
    runner: str
    """the module run as ``python -P -m RUNNER TASK.json`` to stage the guest's model and train it as a rank's
    background child (the coordinator's :mod:`deeppool.coordinator.guest`)"""

    def to_json(self) -> dict[str, Any]:
        return {"control": str(self.control), "runner": self.runner}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GuestsConfig:
        return cls(control=Path(data["control"]), runner=str(data["runner"]))


@dataclass(frozen=True, kw_only=True)
class GuestLoan:
    """Background job ``job_id`` lent the idle windows of the host's ``ranks``: ``steps`` per replica."""

    job_id: int
    ranks: tuple[int, ...]
    model: str
    batch: int
    steps: int
    folder: Path
    """the guest's own folder: its staged model and its checkpoints (``background/``)"""
    roots: tuple[Path, ...] = ()
    """where its model file may come from (checked again by its process)"""
    broker: Path | None = None
    """a guest of another account: the socket of the broker the host's supervisor runs for it, which starts its
    process as its account (the coordinator's :mod:`~deeppool.coordinator.lent_brokers`); None: the rank starts
    it"""

    def __post_init__(self) -> None:
        if not self.ranks or self.batch < 1 or self.steps < 1:
            raise DeeppoolError(f"a loan needs ranks, a batch and steps: {self}")

    def to_json(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "ranks": list(self.ranks), "model": self.model, "batch": self.batch,
                "steps": self.steps, "folder": str(self.folder), "roots": [str(root) for root in self.roots],
                "broker": None if self.broker is None else str(self.broker)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GuestLoan:
        return cls(job_id=int(data["job_id"]), ranks=tuple(int(r) for r in data["ranks"]), model=str(data["model"]),
                   batch=int(data["batch"]), steps=int(data["steps"]), folder=Path(data["folder"]),
                   roots=tuple(Path(root) for root in data.get("roots", ())),
                   broker=Path(data["broker"]) if data.get("broker") else None)


def loans_json(loans: Iterable[GuestLoan]) -> bytes:
    """A control file's bytes (loans by job id)."""
    return json.dumps({"loans": [loan.to_json() for loan in sorted(loans, key=lambda loan: loan.job_id)]},
                      indent=1).encode()


def parse_loans(data: bytes) -> dict[int, GuestLoan] | None:
    """The loans of a control file's bytes, by job id; None when they are not a whole control file."""
    try:
        loans = [GuestLoan.from_json(item) for item in json.loads(data)["loans"]]
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError, DeeppoolError):
        return None
    return {loan.job_id: loan for loan in loans}


class GuestState(enum.Enum):
    RUNNING = "running"
    FINISHED = "finished"
    LEFT = "left"
    STOPPED = "stopped"
    FAILED = "failed"


@dataclass(frozen=True, kw_only=True)
class GuestReport:
    """One replica of a guest on one rank: its state and its checkpoint's step count."""

    job_id: int
    rank: int
    state: GuestState
    steps: int
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "rank": self.rank, "state": self.state.value, "steps": self.steps,
                "error": self.error}

    @classmethod
    def parse(cls, job_id: int, rank: int, data: Any) -> GuestReport | None:
        """What a replica's file says (a job wrote it: anything malformed is None)."""
        if not isinstance(data, dict):
            return None
        steps, error = data.get("steps"), data.get("error")
        try:
            state = GuestState(data.get("state"))
        except ValueError:
            return None
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 1 << 62:
            return None
        return cls(job_id=job_id, rank=rank, state=state, steps=steps,
                   error=error[:500] if isinstance(error, str) else None)


def report_path(folder: Path, job_id: int, rank: int) -> Path:
    """Where replica ``rank`` of guest ``job_id`` is reported, in the host's run folder ``folder``."""
    return folder / "guests" / f"job-{job_id}.rank-{rank}.json"


@dataclass
class _Run:
    loan: GuestLoan
    background: ProcessBackground
    session: Session
    listening: bool = False
    """whether its session is given the windows (once its model has loaded)"""
    at_start: bool = False
    """lent before the host's first step, and not waited for yet"""


class GuestLender:
    """One hosting rank's guests (see the module's docstring); also the listener the executor calls."""

    def __init__(self, plan: Plan, config: GuestsConfig, *, rank: int, out_dir: Path | None) -> None:
        self.config, self.rank = config, rank
        windows = tuple(w.length_ms for w in plan.idle_windows(rank))
        self.hosts = any(length > 0 for length in windows)
        self.predicted_ms = plan.predicted.iteration_ms
        self.throughout = self.hosts and idle_throughout(windows, self.predicted_ms)
        self.out = out_dir or Path(tempfile.mkdtemp(prefix="deeppool-guests-"))
        self.runs: dict[int, _Run] = {}
        self.ended: set[int] = set()  # guests whose replica here finished or failed, while their loan stands
        self.reports: list[GuestReport] = []
        self.results: list[RankBackground] = []
        self.gathered: list[dict[str, Any]] = []  # rank 0, after gather: every rank's reports
        self._leaving: dict[int, threading.Thread] = {}  # replicas being stopped, by guest
        self._lock = threading.Lock()
        self._loans: dict[int, GuestLoan] = {}
        self._stamp: tuple[int, int, int] | None = None
        self._step: int | None = None
        self._first = True  # the run's first step boundary: guests found there were lent at its start
        self._absent: dict[int, float] = {}  # guests whose broker did not answer yet: since when

    @classmethod
    def start(cls, plan: Plan, *, config: GuestsConfig, rank: int, out_dir: Path | None,
              device: torch.device) -> GuestLender:
        """The :class:`~deeppool.executor.engine.idle.StartLender` (guests train on the CPU, ``gate``)."""
        del device
        return cls(plan, config, rank=rank, out_dir=out_dir)

    @property
    def listener(self) -> IdleListener:
        return self

    def foreground(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def opened(self, event: IdleWindowEvent) -> None:
        if event.step != self._step:
            self._step = event.step
            self.boundary()
        for run in self.runs.values():
            if run.listening:
                run.session.opened(event)

    def closed(self, event: IdleWindowEvent, closed_at_s: float) -> None:
        for run in self.runs.values():
            if run.listening:
                run.session.closed(event, closed_at_s)

    def boundary(self) -> None:
        """At a step boundary: start the guests newly lent this rank, end those gone or done."""
        if not self.hosts:
            return
        mine = {job: loan for job, loan in self._read().items() if self.rank in loan.ranks}
        self.ended &= set(mine)
        self._absent = {job: since for job, since in self._absent.items() if job in mine}
        for job_id in [job for job in self.runs if job not in mine]:
            self._end(job_id, GuestState.LEFT)
        for job_id, run in list(self.runs.items()):
            if not run.listening:
                wait = run.at_start and self._step is not None and run.session.config.schedule.shared(self._step)
                run.background.wait_ready(START_WAIT_S if wait else 0.0)
                run.listening, run.at_start = run.background.ready, run.at_start and not wait
            if run.background.proc.poll() is not None:
                self._end(job_id, GuestState.FAILED)
        self._leaving = {job: thread for job, thread in self._leaving.items() if thread.is_alive()}
        for job_id, loan in mine.items():
            if job_id not in self.runs and job_id not in self.ended and job_id not in self._leaving:
                self._try_start(loan)
        self._first = False

    def _try_start(self, loan: GuestLoan) -> None:
        """Start ``loan``'s replica here; a broker not listening yet is asked again at the next boundaries, for
        :data:`BROKER_WAIT_S`. A guest never fails its host: what does not start is reported failed."""
        try:
            self._start(loan, at_start=self._first)
        except BrokerAbsent as err:
            first = self._absent.setdefault(loan.job_id, time.monotonic())
            if time.monotonic() - first > BROKER_WAIT_S:
                self._failed(loan.job_id, f"its process did not start: {err}")
        except (OSError, subprocess.SubprocessError, ValueError, DeeppoolError) as err:
            self._failed(loan.job_id, f"its process did not start: {err}")

    def _failed(self, job_id: int, error: str) -> None:
        self.ended.add(job_id)
        self._report(GuestReport(job_id=job_id, rank=self.rank, state=GuestState.FAILED, steps=0, error=error))

    def _read(self) -> dict[int, GuestLoan]:
        """The loans in force: the file's when it changed and is whole, else those read before (none: no file)."""
        try:
            info = os.stat(self.config.control)
        except FileNotFoundError:
            self._stamp, self._loans = None, {}
            return self._loans
        except OSError:
            return self._loans
        stamp = (info.st_mtime_ns, info.st_size, info.st_ino)
        if stamp != self._stamp:
            try:
                with self.config.control.open("rb") as file:
                    loans = parse_loans(file.read(MAX_CONTROL_BYTES))
            except OSError:
                loans = None
            if loans is not None:
                self._stamp, self._loans = stamp, loans
        return self._loans

    def _start(self, loan: GuestLoan, *, at_start: bool) -> None:
        replica = loan.ranks.index(self.rank)
        folder = self.out / "guests" / f"job-{loan.job_id}"
        folder.mkdir(parents=True, exist_ok=True)
        config = BackgroundConfig(model=Path(loan.model), batch=loan.batch, mode=MuxMode.GATE,
                                  checkpoint_dir=loan.folder / "background")
        spec = {**child_spec(config, rank=replica, stats=folder / "unused"), "stats": None, "steps": loan.steps,
                "progress": str(report_path(self.out, loan.job_id, self.rank)), "idle_after_load": True}
        if loan.broker is not None:  # another account's: its broker starts the same child, as the guest
            child = BrokeredChild.start(loan.broker, {"op": "child", "rank": self.rank})
            self._absent.pop(loan.job_id, None)
            background = ProcessBackground(spec, rank=self.rank, folder=folder, spawn=lambda *_, **__: child)
        else:
            background = ProcessBackground(spec, rank=self.rank, folder=folder, spawn=self._runner(loan, spec))
        session = Session(config, background, predicted_iteration_ms=self.predicted_ms,
                          idle_throughout=self.throughout)
        self.runs[loan.job_id] = _Run(loan=loan, background=background, session=session, at_start=at_start)

    def _runner(self, loan: GuestLoan, spec: dict[str, Any]) -> Callable[..., subprocess.Popen]:
        """What starts a guest of the host's account: the runner, which stages its model, then runs the child."""
        replica = loan.ranks.index(self.rank)
        task = {"op": "child", "model": loan.model, "roots": [str(root) for root in loan.roots],
                "stage": str(loan.folder / f"model-rank{replica}"), "batch": loan.batch, "child": spec}
        task_path = self.out / "guests" / f"job-{loan.job_id}" / f"task-rank{self.rank}.json"
        task_path.write_text(json.dumps(task))
        runner = [sys.executable, "-P", "-m", self.config.runner, str(task_path)]

        def spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen:
            del argv  # the runner stages the model, then runs the same child
            return subprocess.Popen(runner, **kwargs)

        return spawn

    def _end(self, job_id: int, state: GuestState) -> None:
        """Stop the replica on a thread of its own: the training thread goes on at once."""
        run = self.runs.pop(job_id)
        if state is not GuestState.LEFT:
            self.ended.add(job_id)  # not started again while its loan stands
        thread = threading.Thread(target=self._finish, args=(run, state), name=f"guest-{job_id}", daemon=True)
        thread.start()
        self._leaving[job_id] = thread

    def _finish(self, run: _Run, state: GuestState) -> None:
        """Stop the replica (a quit and a checkpoint; killed first if it never loaded) and write its last report:
        ``finished`` when its steps are done, whatever ended it."""
        job_id = run.loan.job_id
        if not run.background.ready and run.background.proc.poll() is None:
            run.background.proc.kill()  # nothing trained yet: nothing to save, and no wait on a loading model
        result = run.session.stop()
        steps = result.start_step + result.steps
        if steps >= run.loan.steps and result.exit_code == 0:
            state = GuestState.FINISHED
        error = None
        if state is GuestState.FAILED:
            error = (result.error or f"its process ended at step {steps} of {run.loan.steps}") + _tail(
                run.background.log_path)
        with self._lock:
            self.results.append(result)
        self._report(GuestReport(job_id=job_id, rank=self.rank, state=state, steps=steps, error=error))

    def _report(self, report: GuestReport) -> None:
        """A replica's last word, in its file and in the run's summary."""
        with contextlib.suppress(OSError):  # a full disk fails no host: its summary still says it
            _write_json(report_path(self.out, report.job_id, self.rank), report.to_json())
        with self._lock:
            self.reports.append(report)

    def stop(self) -> list[RankBackground]:
        """The host's run has ended: every replica still here is stopped (its report says ``stopped``), and the
        stops under way are waited for."""
        for job_id in list(self.runs):
            self._end(job_id, GuestState.STOPPED)
        for thread in self._leaving.values():
            thread.join()
        self._leaving = {}
        return self.results

    def trace_spans(self) -> list[Span]:
        return [span for result in self.results for span in result.trace_spans()]

    def gather(self, comm: Comm, spans: Iterable[Span]) -> dict[str, Any]:
        del spans
        gathered = comm.gather([report.to_json() for report in self.reports])
        if gathered is None:
            return {}
        self.gathered = [item for reports in gathered for item in reports]
        return {GUESTS_KEY: self.gathered}

    def show(self, console: Console) -> None:
        """Rank 0, after :meth:`gather`: one line per replica of a guest this run hosted."""
        for item in self.gathered:
            console.print(f"guest job {item['job_id']} on rank {item['rank']}: {item['state']} at step "
                          f"{item['steps']}" + (f" ({item['error']})" if item["error"] else ""),
                          highlight=False, markup=False)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _tail(log: Path) -> str:
    """The last line of a replica's log, after a colon (nothing when it is empty)."""
    try:
        with log.open("rb") as file:
            file.seek(max(0, log.stat().st_size - 4096))
            lines = [line.strip() for line in file.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return f": {lines[-1][:300]}" if lines else ""

