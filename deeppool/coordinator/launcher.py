"""Starting, watching and stopping jobs on this machine: one supervisor process per job, in its own session.

:class:`LocalLauncher` never waits on a job: it starts
``python -m deeppool.coordinator.supervisor`` with ``start_new_session=True``
and reads the job's state from the supervisor's files
(:class:`~deeppool.coordinator.supervisor.JobFiles`), so a coordinator that
restarts finds its jobs where they were. Every process of an attempt is in the
attempt's cgroup (:mod:`deeppool.coordinator.jobgroup`). Stopping is SIGTERM
(and SIGCONT, for stopped processes) to the supervisor's process group and to
every process of the group, a grace period, then ``cgroup.kill``. An attempt
counts as running, and so holds its GPUs, while any of its processes is left:
a supervisor that died without an exit code has its group killed and is
reported lost only once the group is empty.
"""

from __future__ import annotations

import enum
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from deeppool.coordinator.guest import GuestSpec
from deeppool.coordinator.isolation import Account, ServerShortage, job_env, shortage
from deeppool.coordinator.jobgroup import CgroupRoot, JobGroup
from deeppool.coordinator.jobs import Job, JobKind
from deeppool.coordinator.supervisor import JobCaps, JobFiles, SupervisorSpec
from deeppool.errors import DeeppoolError

SUPERVISOR = "deeppool.coordinator.supervisor"


class LaunchPhase(enum.Enum):
    NOT_STARTED = "not started"  # no supervisor ever took the job's lock
    QUEUED = "queued"  # submitted to a batch system that has not started it yet
    RUNNING = "running"
    EXITED = "exited"
    LOST = "lost"  # its supervisor is gone without an exit code (killed, or the machine restarted)


@dataclass(frozen=True, kw_only=True)
class Resources:
    """What one attempt runs on: ``gpus`` in all, spread over ``nodes`` machines, ``gpus / nodes`` on each."""

    gpus: int = 1
    nodes: int = 1

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus < 1:
            raise DeeppoolError(f"a job needs at least 1 GPU and 1 node, not {self.gpus} GPUs on {self.nodes} nodes")
        if self.gpus % self.nodes:
            raise DeeppoolError(f"gpus {self.gpus} do not split evenly over {self.nodes} nodes: "
                                f"ask for a multiple of {self.nodes}")

    @property
    def per_node(self) -> int:
        return self.gpus // self.nodes


def resources_for(job: Job, nodes: int) -> Resources:
    """A foreground job's GPUs over ``nodes`` machines (``serve --nodes``); a background job's on one."""
    return Resources(gpus=job.held, nodes=nodes if job.kind is JobKind.FOREGROUND else 1)


@dataclass(frozen=True, kw_only=True)
class Observed:
    phase: LaunchPhase
    exit_code: int | None = None


def _alive_supervisor(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) supervisor process, read from /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError as err:
        if shortage(err):  # no descriptors now: not an answer (a lost job would be recorded from it)
            raise ServerShortage(f"process {pid} cannot be looked at now: {err.strerror}") from None
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z" and SUPERVISOR in cmdline


class Launcher(Protocol):
    """Where jobs run: this machine's processes, or a batch system."""

    folder: Path
    brokers_guests: bool
    """whether a job's supervisor can start its guest of another account (:mod:`deeppool.coordinator.guest`)"""

    def files(self, job_id: int, attempt: int) -> JobFiles: ...

    def launch(self, job_id: int, attempt: int, steps: list[list[str]], env: dict[str, str] | None = None,
               resources: Resources = Resources(), account: Account | None = None,
               workdir: Path | None = None, guest: GuestSpec | None = None) -> None: ...

    def observe(self, job_id: int, attempt: int) -> Observed: ...

    def alive(self, job_id: int, attempt: int) -> bool: ...

    def stop(self, job_id: int, attempt: int, grace_s: float = 10.0) -> None: ...


class LocalLauncher:
    def __init__(self, folder: Path, *, cgroups: bool = True, caps: JobCaps | None = None,
                 max_log_bytes: int | None = None) -> None:
        """``folder``: the attempts' files (0711: jobs pass through it, never list it); ``cgroups``: one per
        attempt where a writable cgroup v2 tree exists (else the supervisor's process group); ``caps``: each
        job's process, memory and disk limits."""
        self.folder, self.caps = folder, caps or JobCaps()
        self.max_log_bytes = max_log_bytes  # the supervisor writes the log up to it, then stops the job
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o711)
        self.cgroups = CgroupRoot.here(folder) if cgroups else None
        self.brokers_guests = self.cgroups is not None and os.geteuid() == 0  # a guest's group, its account
        self._children: dict[tuple[int, int], subprocess.Popen] = {}

    def files(self, job_id: int, attempt: int) -> JobFiles:
        return JobFiles(folder=self.folder, job_id=job_id, attempt=attempt)

    def group(self, job_id: int, attempt: int) -> JobGroup | None:
        """The attempt's cgroup: as its spec names it (a server restarted elsewhere still finds it), else new."""
        spec = self.files(job_id, attempt).spec
        if spec.exists():
            try:
                return SupervisorSpec.from_json(json.loads(spec.read_text())).group
            except (OSError, ValueError, KeyError, TypeError):
                pass
        return None if self.cgroups is None else self.cgroups.group(job_id, attempt)

    def launch(self, job_id: int, attempt: int, steps: list[list[str]], env: dict[str, str] | None = None,
               resources: Resources = Resources(), account: Account | None = None,
               workdir: Path | None = None, guest: GuestSpec | None = None) -> None:
        """Start the attempt's supervisor here: its steps run as ``account`` (None: this server's user) in
        ``workdir``; ``resources`` are the scheduler's to respect on one machine; ``guest``: a guest of
        another account, whose processes the supervisor's broker starts."""
        del resources
        files = self.files(job_id, attempt)
        group = None if self.cgroups is None else self.cgroups.group(job_id, attempt)
        SupervisorSpec(job_id=job_id, attempt=attempt, steps=steps, env=env or {}, account=account, workdir=workdir,
                       group=group, guest=guest, caps=self.caps, max_log_bytes=self.max_log_bytes).write(files)
        self._children[(job_id, attempt)] = subprocess.Popen(
            [sys.executable, "-P", "-m", SUPERVISOR, str(files.spec)], start_new_session=True, close_fds=True,
            cwd=self.folder,  # -P and a folder of the server's: nothing is imported from where serve started
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=job_env(None),
        )

    def observe(self, job_id: int, attempt: int) -> Observed:
        self._reap()
        files = self.files(job_id, attempt)
        group = self.group(job_id, attempt)
        code = files.exit_code()
        if code is not None:
            if _ended(group):
                return Observed(phase=LaunchPhase.EXITED, exit_code=code)
            return Observed(phase=LaunchPhase.RUNNING)
        pid = files.supervisor_pid()
        if pid is None:
            return Observed(phase=LaunchPhase.NOT_STARTED)
        if _alive_supervisor(pid):
            return Observed(phase=LaunchPhase.RUNNING)
        code = files.exit_code()  # it may have finished between the two reads
        if not _ended(group):
            # its processes outlived it: killed, they hold the GPUs till gone
            return Observed(phase=LaunchPhase.RUNNING)
        if code is None:
            return Observed(phase=LaunchPhase.LOST)
        return Observed(phase=LaunchPhase.EXITED, exit_code=code)

    def alive(self, job_id: int, attempt: int) -> bool:
        """Whether any process of the attempt is left (its supervisor, or anything in its group)."""
        pid = self.files(job_id, attempt).supervisor_pid()
        group = self.group(job_id, attempt)
        return (pid is not None and _alive_supervisor(pid)) or (group is not None and group.populated())

    def stop(self, job_id: int, attempt: int, grace_s: float = 10.0) -> None:
        """SIGTERM (and SIGCONT) to every process of the attempt; after ``grace_s``, kill whatever is left.

        An attempt launched whose supervisor has not taken its lock yet is stopped by taking the lock here:
        its supervisor then finds it taken and runs nothing.
        """
        files = self.files(job_id, attempt)
        if files.spec.exists() and _claim(files):
            return
        pid = files.supervisor_pid()
        group = self.group(job_id, attempt)
        if not self.alive(job_id, attempt):
            return
        for signum in (signal.SIGTERM, signal.SIGCONT):
            if pid is not None and _alive_supervisor(pid):
                _signal_group(pid, signum)
            if group is not None:
                group.signal(signum)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self._reap()
            if not self.alive(job_id, attempt):
                return
            time.sleep(0.05)
        if group is not None:
            group.end()
        if pid is not None and not self._gone(pid, 2.0):  # a supervisor whose steps are killed writes its exit
            _signal_group(pid, signal.SIGKILL)
            self._gone(pid, 2.0)

    def _gone(self, pid: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the supervisor ``pid`` to end; whether it has."""
        deadline = time.monotonic() + timeout_s
        while _alive_supervisor(pid):
            self._reap()
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def _reap(self) -> None:
        for key, proc in list(self._children.items()):
            if proc.poll() is not None:
                del self._children[key]


def _claim(files: JobFiles) -> bool:
    """Take the attempt's launch lock before its supervisor does (pid 0: no one); whether it was free."""
    try:
        fd = os.open(files.pid, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    os.write(fd, b"0\n")
    os.close(fd)
    return True


def _signal_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        pass


def _ended(group: JobGroup | None) -> bool:
    """Whether the attempt's group has no process left, after killing what is and removing it (no group: True)."""
    return group is None or group.end(timeout_s=2.0)
