"""A job's supervisor: ``python -m deeppool.coordinator.supervisor SPEC.json``, in its own process session.

The coordinator starts one per attempt at a job (a background job that was
preempted and requeued runs again as its next attempt) and does not wait for
it, so a restart of the coordinator does not touch running jobs. The
supervisor first creates ``job-N.A.pid`` with ``O_EXCL``: that file is the
attempt's launch lock, so an attempt never runs twice, even if two supervisors
were started for it. It then runs the job's steps (argv lists, never a shell)
one after the other with their output appended to ``job-N.log``, and stops at
the first that fails. It forwards SIGTERM to the running step, and finally
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
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from deeppool.coordinator.guest import Broker, GuestSpec
from deeppool.coordinator.isolation import Account, job_env, private_dir, read_job_file
from deeppool.coordinator.jobgroup import JobGroup
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
    def guest_socket(self) -> Path:
        """Where the supervisor's broker of a guest of another account listens (the server's folder)."""
        return self._path("guest.sock")

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

    def to_json(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "attempt": self.attempt, "steps": self.steps, "env": self.env,
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
                   guest=GuestSpec.from_json(data["guest"]) if data.get("guest") else None)

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


def _write_exit(files: JobFiles, code: int) -> None:
    tmp = files.exit.with_name(files.exit.name + ".tmp")
    tmp.write_text(f"{code}\n")
    os.replace(tmp, files.exit)


def _prctl(option: int, value: int) -> bool:
    """Whether the kernel took the setting."""
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def enter(group: JobGroup | None, account: Account | None) -> Callable[[], None]:
    """What a step does between fork and exec: join the job's group, then become its account for good."""

    def step() -> None:
        if group is not None:
            group.join()
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


def run(files: JobFiles) -> int:
    try:
        fd = os.open(files.pid, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return 0  # another supervisor owns this job: never run it twice
    os.write(fd, f"{os.getpid()}\n".encode())
    os.close(fd)
    spec = SupervisorSpec.from_json(json.loads(files.spec.read_text()))
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    if spec.group is not None:
        spec.group.create()
    current: list[subprocess.Popen] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        del frame
        for proc in current:
            proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    env = {**job_env(spec.account), **spec.env}
    code = 0
    broker = _broker(spec, files)
    with files.log.open("ab") as log:
        for argv in spec.steps:
            log.write(f"$ {' '.join(argv)}\n".encode())
            log.flush()
            try:
                if spec.workdir is not None:
                    private_dir(spec.workdir, spec.account)
                current[:] = [subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               env=env, cwd=spec.workdir, preexec_fn=enter(spec.group, spec.account))]
            except (OSError, subprocess.SubprocessError, DeeppoolError) as err:
                log.write(f"error: the step could not start: {err}\n".encode())
                code = 127
                break
            code = current[0].wait()
            if code != 0:
                break
    if broker is not None:
        broker.close()
    end_leftovers(spec.group)
    _write_exit(files, code)
    return code


def _broker(spec: SupervisorSpec, files: JobFiles) -> Broker | None:
    """The broker of the attempt's guest of another account, listening (None: no such guest, or no group to
    put its processes in; the host's ranks then find no broker, and run without their guest)."""
    if spec.guest is None or spec.group is None:
        return None
    broker = Broker(spec.guest, files.guest_socket, host=spec.account, group=spec.group)
    try:
        broker.start()
    except (OSError, DeeppoolError) as err:
        with files.log.open("ab") as log:
            log.write(f"deeppool: the guest's broker did not start: {err}\n".encode())
        return None
    return broker


def main() -> None:
    os.umask(0o077)
    spec = Path(sys.argv[1])
    data = json.loads(spec.read_text())
    files = JobFiles(folder=spec.parent, job_id=int(data["job_id"]), attempt=int(data["attempt"]),
                     state_dir=bool(data.get("state_dir")))
    sys.exit(0 if run(files) == 0 else 1)


if __name__ == "__main__":
    main()
