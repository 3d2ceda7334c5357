"""A job is all its processes: one cgroup (v2) per attempt, which a job run as an account of its own
(``serve --job-user``, the server root) cannot leave; a job run as the server's own user could.

:class:`CgroupRoot` is this server's folder in the cgroup v2 tree: under the
server's own cgroup, ``deeppool-HASH`` (the hash of the launcher's folder, so
two servers on one machine never share it, and a restarted server finds its
jobs' groups again; it exists while some attempt's group does). Each attempt's supervisor creates ``job-N.A`` there and
starts every step inside it, before the step drops to the job's account; an
unprivileged process cannot move itself out (the tree is root's), so every
rank, every grandchild and every daemonised orphan stays in the group.
Ending a job is writing ``1`` to ``cgroup.kill``: SIGKILL to every process in
it, stopped ones included, at once. A guest of another account runs in a group
nested in its host attempt's (``job-N.A/guest-M.R``,
:mod:`deeppool.coordinator.guest`), so it ends with its host, and its host's
GPUs are held until it is gone too. ``cgroup.events`` says whether any process
is left (``populated``): a job holds its GPUs until that is 0.

Where no writable cgroup v2 tree exists, :meth:`CgroupRoot.here` is None and
the launcher falls back to the supervisor's process group (the supervisor is
a child subreaper, so orphans come back to it): weaker, as it loses track of a
job whose supervisor is killed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from deeppool.coordinator.isolation import ServerShortage, shortage


def _read(path: Path) -> str:
    """The file's text; "" when it is gone. A server short of descriptors or memory raises
    :class:`~deeppool.coordinator.isolation.ServerShortage` (an empty answer would say the job ended)."""
    try:
        return path.read_text()
    except OSError as err:
        if shortage(err):
            raise ServerShortage(f"'{path}' cannot be read now: {err.strerror}") from None
        return ""


@dataclass(frozen=True)
class JobGroup:
    path: Path

    def create(self) -> None:
        for _ in range(3):  # another attempt's end may remove the server's folder in between: make it again
            try:
                self.path.mkdir(parents=True, exist_ok=True)
                return
            except FileNotFoundError:
                continue
        self.path.mkdir(parents=True, exist_ok=True)

    def limit(self, *, pids: int | None, memory_bytes: int | None) -> tuple[bool, bool]:
        """Set ``pids.max`` and ``memory.max`` (None: no limit asked), first enabling the ``pids`` and ``memory``
        controllers in the server's folder and in the server's own group (``pids``, a threaded controller, is
        enabled there even though the server runs in it; ``memory`` only where that group holds no process,
        the tree's root). Whether each limit is in force (False: no such controller here; the step takes an
        rlimit instead)."""
        for parent in (self.path.parent.parent, self.path.parent):
            for controller in ("pids", "memory"):
                try:
                    (parent / "cgroup.subtree_control").write_text(f"+{controller}\n")
                except OSError:
                    pass
        done = []
        for name, value in (("pids.max", pids), ("memory.max", memory_bytes)):
            if value is None:
                done.append(True)
                continue
            try:
                (self.path / name).write_text(f"{value}\n")
                if name == "memory.max":
                    with contextlib.suppress(OSError):
                        (self.path / "memory.swap.max").write_text("0\n")
                done.append(True)
            except OSError:
                done.append(False)
        return done[0], done[1]

    def join(self) -> None:
        """Move the calling process into the group (a step, before it drops its privileges)."""
        (self.path / "cgroup.procs").write_text("0\n")

    def pids(self) -> list[int]:
        return [int(p) for p in _read(self.path / "cgroup.procs").split()]

    def populated(self) -> bool:
        """Whether any process of the job is left (False once the group is gone)."""
        return any(line.split() == ["populated", "1"] for line in _read(self.path / "cgroup.events").splitlines())

    def signal(self, signum: int) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        """SIGKILL every process in the group, stopped ones too (``cgroup.kill``; else each, frozen first)."""
        if not self.path.is_dir():
            return
        try:
            (self.path / "cgroup.kill").write_text("1\n")
            return
        except OSError:
            pass
        frozen = self.path / "cgroup.freeze"
        try:
            frozen.write_text("1\n")  # no process can fork past the kill
        except OSError:
            pass
        self.signal(signal.SIGKILL)
        try:
            frozen.write_text("0\n")
        except OSError:
            pass

    def wait_empty(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.populated():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def end(self, timeout_s: float = 10.0, *, nested: bool = False) -> bool:
        """Kill every process (in its nested groups too: a guest's), wait until none is left, remove the group
        and its nested groups; whether it is empty. ``nested``: a guest's group, whose parent is its host's."""
        self.kill()
        empty = self.wait_empty(timeout_s)
        if empty:
            for inner in _nested(self.path):
                try:
                    inner.rmdir()
                except OSError:
                    pass
            for folder in (self.path,) if nested else (self.path, self.path.parent):  # the server's folder too,
                try:                                                                  # once no job is left in it
                    folder.rmdir()
                except OSError:
                    break
        return empty


def _nested(path: Path) -> list[Path]:
    """The groups nested in ``path``, deepest first (one a guest's broker removes meanwhile is skipped)."""
    for _ in range(5):
        try:
            return sorted((p for p in path.glob("*/**/") if p != path), key=lambda p: -len(p.parts))
        except FileNotFoundError:
            continue  # a nested group went while it was listed: list again
    return []


@dataclass(frozen=True)
class CgroupRoot:
    path: Path

    @classmethod
    def here(cls, folder: Path) -> CgroupRoot | None:
        """This server's folder in the cgroup v2 tree for the launcher ``folder``, or None where none is writable."""
        mount = next((line.split()[1] for line in _read(Path("/proc/self/mounts")).splitlines()
                      if line.split()[2:3] == ["cgroup2"]), None)
        own = next((line[3:] for line in _read(Path("/proc/self/cgroup")).splitlines() if line.startswith("0::")),
                   None)
        if mount is None or own is None:
            return None
        name = "deeppool-" + hashlib.sha1(str(folder.resolve()).encode()).hexdigest()[:12]
        path = Path(mount) / own.strip().lstrip("/") / name
        if not path.exists():  # made by the first attempt's supervisor; here only tried
            try:
                path.mkdir(mode=0o755)
                path.rmdir()
            except OSError:
                return None
        return cls(path)

    def group(self, job_id: int, attempt: int) -> JobGroup:
        return JobGroup(self.path / f"job-{job_id}.{attempt}")
