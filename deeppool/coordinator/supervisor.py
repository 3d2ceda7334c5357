"""A job's supervisor: ``python -m deeppool.coordinator.supervisor SPEC.json``, in its own process session.

The coordinator starts one per attempt at a job (a background job that was
preempted and requeued runs again as its next attempt) and does not wait for
it, so a restart of the coordinator does not touch running jobs. The
supervisor first creates ``job-N.A.pid`` with ``O_EXCL``: that file is the
attempt's launch lock, so an attempt never runs twice, even if two supervisors
were started for it. It then runs the job's steps (argv lists, never a shell)
one after the other with their output appended to ``job-N.log``, and stops at
the first that fails. The output comes through a pipe the supervisor copies
(:class:`CappedOutput`): at the log's cap (``serve --max-log-mb``) it writes
no more, records why in ``job-N.A.stopped`` and kills the attempt. It forwards SIGTERM to the running step, and finally
writes the exit code to ``job-N.A.exit`` atomically (a temporary file, then
``os.replace``). A restarted coordinator finalises the job from that file.

The supervisor is the server's (root's, when jobs run as their own accounts):
the job never owns its lock, log or exit files. Each step starts in the
attempt's cgroup (:mod:`deeppool.coordinator.jobgroup`) and then drops to the
job's account (supplementary groups, gid, uid, ``no_new_privs``), in the
job's own folder, with an environment built from an allow-list
(:func:`~deeppool.coordinator.isolation.job_env`). When the steps end,
whatever they left behind (daemonised grandchildren, stopped processes) is
killed and waited for before the exit file is written, so an attempt that has
an exit code has no process left. Without a cgroup, the supervisor is a child
subreaper and kills its remaining descendants instead.

While a step runs the supervisor reaps the orphans re-parented to it (never
its steps' or its brokers' processes), starts and retires the brokers of the
guests of other accounts the server lends the running attempt
(:mod:`deeppool.coordinator.lent_brokers`), and holds the job to its
:class:`JobCaps`: ``pids.max`` and ``memory.max`` in its cgroup (else
``RLIMIT_NPROC`` and ``RLIMIT_DATA``), its folder's size (watched), and, as
root, a mount and IPC namespace per step with a private tmpfs on ``/tmp`` and
``/dev/shm`` (:func:`private_namespaces`). The exit file's room is taken at
start, and a supervisor that cannot write it for want of space retries; one
that fails itself writes exit code 125 and why (``job-N.A.stopped``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import resource
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from deeppool.coordinator.guest import Broker, GuestSpec
from deeppool.coordinator.isolation import Account, job_env, private_dir, read_job_file
from deeppool.coordinator.jobgroup import JobGroup
from deeppool.coordinator.lent_brokers import LentBrokers
from deeppool.errors import DeeppoolError

PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38


@dataclass(frozen=True, kw_only=True)
class JobFiles:
    """An attempt's files in the launcher's ``folder``. With ``state_dir`` (Slurm's attempts, whose supervisor
    runs as the job's account there), its lock and exit file are in ``job-N.A.d``, a folder of the account's."""

    folder: Path
    job_id: int
    attempt: int
    state_dir: bool = False

    def _path(self, suffix: str) -> Path:
        return self.folder / f"job-{self.job_id}.{self.attempt}.{suffix}"

    @property
    def state(self) -> Path:
        """Where the supervisor writes its lock and exit file (the launcher's folder, or ``job-N.A.d``)."""
        return self._path("d") if self.state_dir else self.folder

    @property
    def spec(self) -> Path:
        return self._path("json")

    @property
    def pid(self) -> Path:
        return self.state / f"job-{self.job_id}.{self.attempt}.pid"

    @property
    def exit(self) -> Path:
        return self.state / f"job-{self.job_id}.{self.attempt}.exit"

    @property
    def log(self) -> Path:
        return self.folder / f"job-{self.job_id}.log"

    @property
    def stopped(self) -> Path:
        """Why the supervisor stopped the attempt itself (its log reached the cap), written before it stops it."""
        return self.state / f"job-{self.job_id}.{self.attempt}.stopped"

    def stopped_reason(self) -> str | None:
        """The reason in :attr:`stopped`, if the server's user wrote it (a supervisor of the server's; under
        Slurm the job's account owns ``job-N.A.d``, and what it wrote there is no reason)."""
        data = read_job_file(self.stopped, None, 500)
        return None if not data else data.decode(errors="replace").strip()[:500] or None

    @property
    def guests_control(self) -> Path:
        """The loans of guests that join the running attempt, which the server writes and its ranks watch
        (:mod:`deeppool.multiplex.guests`)."""
        return self._path("guests.json")

    @property
    def guest_socket(self) -> Path:
        """Where the supervisor's broker of a guest of another account listens (the server's folder)."""
        return self._path("guest.sock")

    @property
    def guest_brokers(self) -> Path:
        """The guests of other accounts lent the running attempt, whose brokers the supervisor runs (the server's
        file: :mod:`deeppool.coordinator.lent_brokers`)."""
        return self._path("brokers.json")

    def lent_socket(self, guest_id: int) -> Path:
        """Where the broker of guest ``guest_id``, lent the running attempt, listens (the server's folder)."""
        return self._path(f"guest-{guest_id}.sock")

    def exit_code(self) -> int | None:
        return _number(self.exit)

    def supervisor_pid(self) -> int | None:
        return _number(self.pid)


def _number(path: Path) -> int | None:
    """The integer in a supervisor's small file: never read through a link or from a FIFO (the file may be in
    a folder of the job's account), None when it is not one."""
    data = read_job_file(path, None, 64, any_owner=True)
    try:
        return None if data is None else int(data.decode().strip())
    except (ValueError, UnicodeDecodeError):
        return None


@dataclass(frozen=True, kw_only=True)
class JobCaps:
    """One attempt's limits (None: none). ``pids`` and ``memory_bytes`` go in its cgroup's ``pids.max`` and
    ``memory.max`` where those controllers exist, else in each step's ``RLIMIT_NPROC`` (the job's account's
    processes; not enforced for root) and ``RLIMIT_DATA``; ``disk_bytes`` caps the job's folder (watched by the
    supervisor, which stops the job past it) and sizes its private ``/tmp`` and ``/dev/shm``."""

    pids: int | None = None
    memory_bytes: int | None = None
    disk_bytes: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"pids": self.pids, "memory_bytes": self.memory_bytes, "disk_bytes": self.disk_bytes}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobCaps:
        def number(key: str) -> int | None:
            return None if data.get(key) is None else int(data[key])

        return cls(pids=number("pids"), memory_bytes=number("memory_bytes"), disk_bytes=number("disk_bytes"))


@dataclass(frozen=True, kw_only=True)
class SupervisorSpec:
    """What one attempt's supervisor runs, as whom, where, in which group, with which environment."""

    job_id: int
    attempt: int
    steps: list[list[str]]
    env: dict[str, str]
    """variables the launcher sets on top of the allow-listed ones
    (:func:`~deeppool.coordinator.isolation.job_env`)"""
    account: Account | None = None
    workdir: Path | None = None
    group: JobGroup | None = None
    guest: GuestSpec | None = None
    """a guest of another account, whose processes this supervisor's broker starts"""
    caps: JobCaps = JobCaps()
    """the job's process, memory and disk limits (``serve --max-job-pids``, ``--max-job-memory-mb``,
    ``--max-job-disk-mb``)"""
    max_log_bytes: int | None = None
    """the log's cap (``serve --max-log-mb``): the supervisor writes no more past it, and stops the attempt"""

    def to_json(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "attempt": self.attempt, "steps": self.steps, "env": self.env,
                "caps": self.caps.to_json(), "max_log_bytes": self.max_log_bytes,
                "account": None if self.account is None else self.account.to_json(),
                "workdir": None if self.workdir is None else str(self.workdir),
                "group": None if self.group is None else str(self.group.path),
                "guest": None if self.guest is None else self.guest.to_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SupervisorSpec:
        return cls(job_id=int(data["job_id"]), attempt=int(data["attempt"]), steps=data["steps"],
                   env=dict(data.get("env") or {}),
                   account=Account.from_json(data["account"]) if data.get("account") else None,
                   workdir=Path(data["workdir"]) if data.get("workdir") else None,
                   group=JobGroup(Path(data["group"])) if data.get("group") else None,
                   guest=GuestSpec.from_json(data["guest"]) if data.get("guest") else None,
                   caps=JobCaps.from_json(data.get("caps") or {}),
                   max_log_bytes=int(data["max_log_bytes"]) if data.get("max_log_bytes") else None)

    def write(self, files: JobFiles, reader: Account | None = None) -> None:
        """The spec beside the attempt's files, atomically, readable by the server's user only (or by
        ``reader``, the account a supervisor under Slurm runs as)."""
        tmp = files.spec.with_name(files.spec.name + ".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        if reader is not None:
            os.fchown(fd, reader.uid, reader.gid)
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps({**self.to_json(), "state_dir": files.state_dir}))
        os.replace(tmp, files.spec)


EXIT_WIDTH = 16
"""Bytes reserved for the exit code: the supervisor writes its exit file into room it took when it started."""


def _reserve_exit(files: JobFiles) -> None:
    """Take the room of the exit file now, while there is space (a job may fill the disk before it ends)."""
    tmp = files.exit.with_name(files.exit.name + ".tmp")
    with contextlib.suppress(OSError):
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            os.write(fd, b" " * (EXIT_WIDTH - 1) + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_exit(files: JobFiles, code: int) -> None:
    """The exit file, atomically, into the room :func:`_reserve_exit` took. Where that fails (no space, no
    descriptors) the supervisor stays and retries every second: while it lives the job counts as running, so
    the server never records it lost for want of space."""
    tmp = files.exit.with_name(files.exit.name + ".tmp")
    data = f"{code}".encode().ljust(EXIT_WIDTH - 1) + b"\n"
    while True:
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW)  # the room reserved: no new block needed
            except FileNotFoundError:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            try:
                os.pwrite(fd, data, 0)
                os.ftruncate(fd, len(data))
            finally:
                os.close(fd)
            os.replace(tmp, files.exit)
            return
        except OSError as err:
            if err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EMFILE, errno.ENFILE, errno.ENOMEM):
                raise  # its folder is gone: no record to keep
            time.sleep(1.0)


def _note(log: Any, data: bytes) -> None:
    """A line of the supervisor's own in the job's log; a full disk loses the line, never the job's record."""
    with contextlib.suppress(OSError, ValueError):
        log.write(data)
        log.flush()


def _prctl(option: int, value: int) -> bool:
    """Whether the kernel took the setting."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


CLONE_NEWNS, CLONE_NEWIPC = 0x00020000, 0x08000000
MS_NOSUID, MS_NODEV, MS_BIND, MS_REC, MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 1 << 18
PRIVATE_MOUNTS = ("/tmp", "/dev/shm")
_LIBC = ctypes.CDLL(None, use_errno=True)
DEFAULT_TMP_BYTES = 1 << 30
"""The size of a job's private ``/tmp`` and ``/dev/shm`` each when it has no disk cap."""


def private_namespaces(tmp_bytes: int | None) -> None:
    """Give the calling process (a step, still root, after fork) its own mount and IPC namespaces: a fresh
    tmpfs on ``/tmp`` and ``/dev/shm`` and its own SysV IPC, all gone when its last process is."""
    libc = _LIBC  # loaded before the fork: no dlopen (nor its lock) between fork and exec
    if libc.unshare(CLONE_NEWNS | CLONE_NEWIPC) != 0:
        return  # a server without the right (a container without CAP_SYS_ADMIN): the shared ones, as before
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), "the job's mounts could not be made private")
    size = f"mode=1777,size={tmp_bytes or DEFAULT_TMP_BYTES}".encode()
    for target in PRIVATE_MOUNTS:
        if not os.path.isdir(target):
            continue
        shown = _kept(target)
        below = os.open(target, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)  # the shared one, under the new
        try:
            if libc.mount(b"tmpfs", target.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, size) != 0:
                raise OSError(ctypes.get_errno(), f"the job's private {target} could not be mounted")
            for name, is_dir in shown:  # the server's folders there (a job's own folder may be one) stay seen
                place = os.path.join(target, name)
                if is_dir:
                    os.mkdir(place, 0o700)
                else:
                    os.close(os.open(place, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
                source = f"/proc/self/fd/{below}/{name}".encode()
                if libc.mount(source, place.encode(), None, MS_BIND | MS_REC, None) != 0:
                    raise OSError(ctypes.get_errno(), f"'{place}' could not be kept in the job's private {target}")
        finally:
            os.close(below)


def _kept(folder: str) -> list[tuple[str, bool]]:
    """The entries of a shared ``folder`` a job's private one keeps (bound in place): those of root or the
    server's user that others cannot write in (a server's folders of jobs and models). Whatever else is there
    (other users' files, world-writable folders) the job does not see, and what it makes there is its own."""
    kept = []
    for entry in os.scandir(folder):
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if info.st_uid in (0, os.geteuid()) and not info.st_mode & 0o002 and (
                stat.S_ISDIR(info.st_mode) or stat.S_ISREG(info.st_mode)):
            kept.append((entry.name, stat.S_ISDIR(info.st_mode)))
    return kept


def set_rlimits(caps: JobCaps, *, pids: bool, memory: bool) -> None:
    """The caps the job's cgroup could not take, as the step's own rlimits (lowered only)."""
    for wanted, kind, value in ((pids, resource.RLIMIT_NPROC, caps.pids),
                                (memory, resource.RLIMIT_DATA, caps.memory_bytes)):
        if wanted and value is not None:
            hard = resource.getrlimit(kind)[1]
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(kind, (value, value))


def enter(group: JobGroup | None, account: Account | None, caps: JobCaps | None = None, *,
          rlimits: tuple[bool, bool] = (False, False), private: bool = False) -> Callable[[], None]:
    """What a step does between fork and exec: join the job's group, take its private ``/tmp``, ``/dev/shm``
    and IPC (``private``), its rlimits (``rlimits``: pids, memory; where the group has no such controller),
    then become its account for good."""

    def step() -> None:
        if group is not None:
            group.join()
        if private:
            private_namespaces(None if caps is None else caps.disk_bytes)
        if caps is not None:
            set_rlimits(caps, pids=rlimits[0], memory=rlimits[1])
        if account is not None:
            os.setgroups(list(account.groups))
            os.setresgid(account.gid, account.gid, account.gid)
            os.setresuid(account.uid, account.uid, account.uid)
        if not _prctl(PR_SET_NO_NEW_PRIVS, 1):
            raise OSError("the job's step could not set no_new_privs: it does not start")

    return step


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (by parent links in /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def end_leftovers(group: JobGroup | None) -> None:
    """Kill what the steps left running (grandchildren, stopped processes) and wait until none is left."""
    if group is not None:
        group.end()
        return
    for _ in range(50):
        left = descendants(os.getpid())
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            pass
        time.sleep(0.02)


class CappedOutput:
    """The steps' output, through a pipe the supervisor copies into the job's log: the write that would take
    the log (its whole size, earlier attempts included) past ``cap`` bytes is cut there and followed by a
    notice, then ``on_cap`` runs (it stops the attempt); the rest is read and dropped."""

    def __init__(self, log: Path, cap: int, on_cap: Callable[[], None]) -> None:
        self.cap, self.on_cap, self.over = cap, on_cap, False
        self.log = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
        self._read, self.fd = os.pipe()
        self._pump = threading.Thread(target=self._copy, daemon=True)
        self._pump.start()

    def _copy(self) -> None:
        while chunk := os.read(self._read, 1 << 16):
            if self.over:
                continue
            with contextlib.suppress(OSError):  # a full disk loses output, never the job's record
                room = self.cap - os.fstat(self.log).st_size
                if len(chunk) > room:
                    chunk, self.over = chunk[:max(0, room)], True
                _write_all(self.log, chunk)
                if self.over:
                    _write_all(self.log, f"\ndeeppool: this job's log passed the cap of {self.cap} bytes: the job "
                                         "was stopped\n".encode())
            if self.over:
                self.on_cap()
        os.close(self._read)

    def close_writer(self) -> None:
        """Every step has been started: only the job's processes hold the pipe now."""
        os.close(self.fd)

    def drain(self) -> None:
        """After the job's last process is gone: the pipe is at its end."""
        self._pump.join(10)
        os.close(self.log)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def log_cap_reason(cap: int) -> str:
    return f"its log passed the cap of {cap} bytes (serve --max-log-mb): stopped"


def _stop_at_cap(spec: SupervisorSpec, files: JobFiles) -> None:
    """The job's log reached its cap: the reason first (the exit file, written later, finds it), then every
    process of the attempt is killed."""
    with contextlib.suppress(OSError):
        files.stopped.write_text(log_cap_reason(spec.max_log_bytes or 0) + "\n")
    if spec.group is not None:
        spec.group.kill()
        return
    for pid in descendants(os.getpid()):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def run(files: JobFiles) -> int:
    try:
        fd = os.open(files.pid, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return 0  # another supervisor owns this job: never run it twice
    os.write(fd, f"{os.getpid()}\n".encode())
    os.close(fd)
    _reserve_exit(files)
    spec = SupervisorSpec.from_json(json.loads(files.spec.read_text()))
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    in_group = (False, False)
    if spec.group is not None:
        spec.group.create()
        in_group = spec.group.limit(pids=spec.caps.pids, memory_bytes=spec.caps.memory_bytes)
    rlimits = (not in_group[0], not in_group[1])
    private = os.geteuid() == 0  # a mount and IPC namespace of its own: root's to make
    current: list[subprocess.Popen] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        del frame
        for proc in current:
            proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    env = {**job_env(spec.account), **spec.env}
    code = 0
    broker = _broker(spec, files)
    lent = LentBrokers(files, host=spec.account, group=spec.group) if spec.group is not None and private else None
    with files.log.open("ab") as log:
        output = None if spec.max_log_bytes is None else CappedOutput(files.log, spec.max_log_bytes,
                                                                      lambda: _stop_at_cap(spec, files))
        for argv in spec.steps:
            _note(log, f"$ {' '.join(argv)}\n".encode())
            try:
                if spec.workdir is not None:
                    private_dir(spec.workdir, spec.account)
                current[:] = [subprocess.Popen(argv, stdout=log if output is None else output.fd,
                                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               env=env, cwd=spec.workdir,
                                               preexec_fn=enter(spec.group, spec.account, spec.caps, rlimits=rlimits,
                                                                private=private))]
            except (OSError, subprocess.SubprocessError, DeeppoolError) as err:
                _note(log, f"error: the step could not start: {err}\n".encode())
                code = 127
                break
            code = _wait(current[0], spec, files, Brokers(at_start=broker, lent=lent), log)
            if code != 0 or (output is not None and output.over):
                break
        if output is not None:
            output.close_writer()
    if broker is not None:
        broker.close()
    if lent is not None:
        lent.close()
    end_leftovers(spec.group)
    if output is not None:
        output.drain()
    _write_exit(files, code)
    return code


REAP_S = 0.1
"""How often the supervisor reaps the job's orphans and looks at its folder's size."""
DISK_CHECK_S = 1.0


def reap_orphans(keep: set[int]) -> int:
    """Reap every exited process re-parented to this supervisor (a child subreaper), leaving those in ``keep``
    (the steps and the broker's processes, whose owners want their status); how many were reaped."""
    reaped = 0
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return reaped
        if info is None or info.si_pid in keep:
            return reaped  # none exited, or one its owner reaps
        try:
            os.waitpid(info.si_pid, 0)
            reaped += 1
        except ChildProcessError:
            pass


def folder_bytes(folder: Path) -> int:
    """The disk space the files under ``folder`` take (never following links)."""
    total, todo = 0, [str(folder)]
    while todo:
        try:
            entries = list(os.scandir(todo.pop()))
        except OSError:
            continue
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
                total += info.st_blocks * 512
                if entry.is_dir(follow_symlinks=False):
                    todo.append(entry.path)
            except OSError:
                continue
    return total


@dataclass(frozen=True, kw_only=True)
class Brokers:
    """The brokers a supervisor runs: of the guest given at its start, of the guests lent while it runs."""

    at_start: Broker | None
    lent: LentBrokers | None

    def spawned(self) -> set[int]:
        return {*(self.at_start.spawned if self.at_start is not None else ()),
                *(self.lent.spawned if self.lent is not None else ())}


def _wait(step: subprocess.Popen, spec: SupervisorSpec, files: JobFiles, brokers: Brokers, log: Any) -> int:
    """The step's exit code; meanwhile, orphans are reaped (no zombie piles up), the brokers of guests lent the
    running attempt are started and retired as the server says, and a job whose folder passes its disk cap is
    stopped, with a line in its log saying so."""
    checked = time.monotonic()
    while (code := step.poll()) is None:
        if brokers.lent is not None:
            brokers.lent.update(files.log)
        reap_orphans({step.pid, *brokers.spawned()})
        cap = spec.caps.disk_bytes
        if cap is not None and spec.workdir is not None and time.monotonic() - checked >= DISK_CHECK_S:
            checked = time.monotonic()
            used = folder_bytes(spec.workdir)
            if used > cap:
                with contextlib.suppress(OSError):  # the job's reason, found with its exit code
                    files.stopped.write_text(f"its folder passed the disk cap of {cap} bytes (serve "
                                             "--max-job-disk-mb): stopped\n")
                _note(log, f"\ndeeppool: the job's folder passed its cap of {cap} bytes (serve --max-job-disk-mb, "
                           f"{used} used): the job was stopped\n".encode())
                end_leftovers(spec.group)  # every process of the job, the step too
                step.wait()
                return DISK_CAP_CODE
        time.sleep(REAP_S)
    return code


DISK_CAP_CODE = 120
"""The exit code of a job stopped at its disk cap."""


def _broker(spec: SupervisorSpec, files: JobFiles) -> Broker | None:
    """The broker of the attempt's guest of another account, listening (None: no such guest, or no group to
    put its processes in; the host's ranks then find no broker, and run without their guest)."""
    if spec.guest is None or spec.group is None:
        return None
    broker = Broker(spec.guest, files.guest_socket, host=spec.account, group=spec.group)
    try:
        broker.start()
    except (OSError, DeeppoolError) as err:
        with contextlib.suppress(OSError), files.log.open("ab") as log:
            _note(log, f"deeppool: the guest's broker did not start: {err}\n".encode())
        return None
    return broker


def main() -> None:
    os.umask(0o077)
    spec = Path(sys.argv[1])
    data = json.loads(spec.read_text())
    files = JobFiles(folder=spec.parent, job_id=int(data["job_id"]), attempt=int(data["attempt"]),
                     state_dir=bool(data.get("state_dir")))
    try:
        code = run(files)
    except Exception as err:  # an attempt whose lock is this supervisor's ends with a true record
        if files.supervisor_pid() != os.getpid():
            raise
        _failed(files, data, err)
        raise
    sys.exit(0 if code == 0 else 1)


def _failed(files: JobFiles, data: dict[str, Any], err: Exception) -> None:
    """The supervisor itself failed (a full disk when it opened the log, say): end what the attempt runs and
    write its exit code with the reason, so the job is recorded failed for that, never lost."""
    group = JobGroup(Path(data["group"])) if data.get("group") else None
    with contextlib.suppress(Exception):
        end_leftovers(None)
        end_leftovers(group)
    with contextlib.suppress(OSError):
        files.stopped.write_text(f"its supervisor failed: {type(err).__name__}: {str(err)[:300]}\n")
    _write_exit(files, SUPERVISOR_FAILED_CODE)


SUPERVISOR_FAILED_CODE = 125
"""The exit code of an attempt whose supervisor failed (its reason says how)."""


if __name__ == "__main__":
    main()
