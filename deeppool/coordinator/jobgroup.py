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
                done.append(self._limit_v1(name.split(".")[0], value))
        return done[0], done[1]

    def v1_groups(self) -> dict[str, Path]:
        """The attempt's groups in the cgroup v1 hierarchies of the ``pids`` and ``memory`` controllers, where a
        hybrid host mounts them (its v2 tree then has neither): the same path from ``deeppool-HASH`` on, under
        the server's own group in each hierarchy."""
        parts = self.path.parts
        start = next((i for i, part in enumerate(parts) if part.startswith("deeppool-")), None)
        if start is None:
            return {}
        return {controller: root / Path(*parts[start:]) for controller, root in v1_roots().items()}

    def _limit_v1(self, controller: str, value: int) -> bool:
        """Set the limit in the ``controller`` v1 hierarchy (``pids.max``; ``memory.limit_in_bytes``, and the
        same for memory and swap); whether it is in force."""
        group = self.v1_groups().get(controller)
        if group is None:
            return False
        names = ("pids.max",) if controller == "pids" else ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
        try:
            group.mkdir(parents=True, exist_ok=True)
            (group / names[0]).write_text(f"{value}\n")
        except OSError:
            return False
        for name in names[1:]:
            with contextlib.suppress(OSError):
                (group / name).write_text(f"{value}\n")
        return True

    def join(self) -> None:
        """Move the calling process into the group (a step, before it drops its privileges), and into its v1
        groups that exist (where :meth:`limit` made them)."""
        (self.path / "cgroup.procs").write_text("0\n")
        for group in self.v1_groups().values():
            if group.is_dir():
                (group / "cgroup.procs").write_text("0\n")

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
            for group in self.v1_groups().values():
                _remove_v1(group, nested=nested)
        return empty


def v1_roots() -> dict[str, Path]:
    """The server's own group in each cgroup v1 hierarchy of the ``pids`` and ``memory`` controllers mounted here."""
    mounts: dict[str, Path] = {}
    for line in _read(Path("/proc/self/mounts")).splitlines():
        fields = line.split()
        if fields[2:3] == ["cgroup"] and len(fields) > 3:
            for controller in ("pids", "memory"):
                if controller in fields[3].split(","):
                    mounts[controller] = Path(fields[1])
    roots: dict[str, Path] = {}
    for line in _read(Path("/proc/self/cgroup")).splitlines():
        _, controllers, own = (line.split(":", 2) + ["", ""])[:3]
        for controller in set(controllers.split(",")) & mounts.keys():
            roots[controller] = mounts[controller] / own.strip().lstrip("/")
    return roots


def _remove_v1(group: Path, *, nested: bool) -> None:
    """Remove an ended attempt's v1 group (its processes may take a moment to leave it) and, unless ``nested``,
    the server's folder there once no attempt is left in it."""
    for _ in range(100):
        try:
            group.rmdir()
            break
        except FileNotFoundError:
            break
        except OSError:
            time.sleep(0.01)
    if not nested:
        with contextlib.suppress(OSError):
            group.parent.rmdir()


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
