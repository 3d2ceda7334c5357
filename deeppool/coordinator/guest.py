"""A guest of another account: a background job lent a foreground job's idle windows, never run by its host.

When the guest's jobs run as another account than its host's
(``serve --job-user submitter``, two users), the host's ranks cannot start
the guest's processes: they would run as the host. The host's supervisor
(root) runs a :class:`Broker` instead, on a Unix socket of its own
(``job-N.A.guest.sock`` in the server's folder, the host's account's alone).
A host process asks it for one of two things, one JSON line each:

* ``{"op": "measure"}``: the guest's memory estimate (the multiplexer's
  preflight), measured by a process of the guest's;
* ``{"op": "child", "rank": R}``: the background process of rank R
  (:mod:`deeppool.multiplex.child`), in ``gate`` mode on the CPU (MPS, the
  GPU's way, serves one account's processes only).

The broker starts that process as the guest's account, in a cgroup of its own
inside the host attempt's (``guest-M.R``: ending the host ends it, and the
host's GPUs are held until it is gone), in the guest's own folder, with the
guest's environment, its output appended to the guest's log. Everything it
runs comes from the server (the guest's model file, batch, allowed roots):
the host chooses only the rank. The process stages
the guest's model file itself (:func:`~deeppool.coordinator.isolation.stage_model`,
as the guest's account) and loads that copy. The broker hands the host the
process's stdin and stdout pipes and a descriptor of its group's
``cgroup.freeze`` (opened by root), over the socket (``SCM_RIGHTS``): the host
sends window tokens down the pipe, freezes the group when a window closes and
thaws it when the next opens (the gate's ``SIGSTOP``/``SIGCONT``, which it
may not send to another account), and reads the statistics from the pipe
when the process ends, never from the guest's folder. The broker tells the
host the process's exit code on the socket; a host that closes the socket, or
dies, or asks ``kill``, has the process's group killed.

A guest of another account lent to the host while it runs has a broker of its
own, which the same supervisor starts when the server names the guest
(:mod:`deeppool.coordinator.lent_brokers`), on ``job-N.A.guest-M.sock``: it
starts only the ranks of the guest's loan, each as the replica its place in
the loan says (seeding and checkpointing as it, training the loan's steps,
saying how far it is in the guest's own folder, :func:`replica_progress`),
and measures nothing.

The host's side is :mod:`deeppool.multiplex.remote`. A guest of the host's own
account lent while the host runs is started by the host's rank itself, with
the same :func:`main` (:mod:`deeppool.multiplex.guests`).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deeppool.coordinator.isolation import Account, job_env, private_dir, stage_model, write_private
from deeppool.coordinator.jobgroup import JobGroup
from deeppool.errors import DeeppoolError
from deeppool.multiplex.remote import as_json, recv

MAX_REQUEST = 512
"""The longest request line a broker reads."""
MAX_PROCESSES = 256
"""The most guest processes one broker runs at once."""


@dataclass(frozen=True, kw_only=True)
class GuestSpec:
    """The guest a host's broker starts processes for: all from the server, nothing from the host."""

    job_id: int
    account: Account
    folder: Path
    """the guest's own folder (``job-M``, 0700, its account's): its staged model, checkpoints, specs"""
    log: Path
    """the guest's job log, where its processes' output goes"""
    model: str
    batch: int
    roots: tuple[Path, ...] = ()
    ranks: int = 0
    """the host's ranks (its GPUs): the only ranks whose background it may ask for"""
    lent: tuple[int, ...] = ()
    """a guest lent to the running host (:mod:`deeppool.coordinator.lent_brokers`): the host's ranks it was lent,
    the only ones it may ask for (replica ``i`` is rank ``lent[i]``); empty: a guest given at the host's start"""
    steps: int = 0
    """a lent guest's steps per replica (its process stops by itself once its checkpoint holds them)"""

    def to_json(self) -> dict[str, Any]:
        return {"job_id": self.job_id, "account": self.account.to_json(), "folder": str(self.folder),
                "log": str(self.log), "model": self.model, "batch": self.batch,
                "roots": [str(root) for root in self.roots], "ranks": self.ranks, "lent": list(self.lent),
                "steps": self.steps}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GuestSpec:
        return cls(job_id=int(data["job_id"]), account=Account.from_json(data["account"]),
                   folder=Path(data["folder"]), log=Path(data["log"]), model=str(data["model"]),
                   batch=int(data["batch"]), roots=tuple(Path(root) for root in data.get("roots", ())),
                   ranks=int(data.get("ranks", 0)), lent=tuple(int(rank) for rank in data.get("lent", ())),
                   steps=int(data.get("steps", 0)))

    def allows(self, request: Request) -> bool:
        """Whether the host's plan has what ``request`` asks for (one measurement is counted by the broker): a
        guest given at the host's start, a rank below its GPU count, or the measurement; a lent guest, a rank
        of its loan, never a measurement (nothing of it was measured when its host planned)."""
        if request.op == "measure":
            return not self.lent
        return request.rank in self.lent if self.lent else request.rank < self.ranks


def replica_progress(folder: Path, replica: int) -> Path:
    """Where replica ``replica`` of a lent guest of another account says how far it is: its own folder, as its
    own account, so the server reads its steps from the guest, never from its host."""
    return folder / f"progress-replica{replica}.json"


@dataclass(frozen=True, kw_only=True)
class Request:
    """What a host may ask: ``measure``, or the ``child`` of a rank (checked; all else is the server's)."""

    op: str
    rank: int = 0

    @classmethod
    def parse(cls, line: bytes) -> Request | None:
        """The request, or None when it is not one a host may make."""
        data = as_json(line)
        rank = data.get("rank", 0)
        if data.get("op") not in ("measure", "child") or isinstance(rank, bool) or not isinstance(rank, int) \
                or not 0 <= rank < 4096:
            return None
        return cls(op=str(data["op"]), rank=rank)

    @property
    def name(self) -> str:
        return "measure" if self.op == "measure" else f"rank{self.rank}"


class Broker:
    """The host supervisor's server of guest processes (see the module's docstring)."""

    def __init__(self, spec: GuestSpec, path: Path, *, host: Account | None, group: JobGroup) -> None:
        self.spec, self.path, self.host, self.group = spec, path, host, group
        self._server: socket.socket | None = None
        self._lock = threading.Lock()
        self._running: set[str] = set()  # one process per request name (rank) at a time
        self._measured = False  # the host's plan has one measurement
        self._spawning = threading.Lock()
        self.spawned: set[int] = set()  # the processes it started: the supervisor's reaper leaves them to it
        self._leave_by: float | None = None  # retired: when what still runs of the guest is killed

    def start(self) -> None:
        """Listen on ``path`` (0600, the host's account's); serve each connection on a thread of its own."""
        private_dir(self.spec.folder, self.spec.account)
        self.path.unlink(missing_ok=True)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(str(self.path))
        os.chmod(self.path, 0o600, follow_symlinks=False)
        if self.host is not None:
            os.chown(self.path, self.host.uid, self.host.gid, follow_symlinks=False)
        server.listen(64)
        self._server = server
        threading.Thread(target=self._accept, name="guest-broker", daemon=True).start()

    def retire(self, grace_s: float) -> None:
        """The guest left its host: take no new request, and kill what of it still runs ``grace_s`` from now (the
        host's rank asks it to quit at its next step boundary; it saves its checkpoint first)."""
        self._leave_by = time.monotonic() + grace_s
        self.close()

    def close(self) -> None:
        if self._server is not None:
            with contextlib.suppress(OSError):
                self._server.shutdown(socket.SHUT_RDWR)
            self._server.close()
        self.path.unlink(missing_ok=True)

    def _accept(self) -> None:
        assert self._server is not None
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """One request: start the process, hand over its pipes, report its end; kill it if the host goes."""
        with conn:
            request = Request.parse(_line(conn, MAX_REQUEST))
            with self._lock:  # the host's plan: ranks it has, one measurement, one process per rank at a time
                refused = request is None or request.name in self._running or len(self._running) >= MAX_PROCESSES \
                    or not self.spec.allows(request) or (request.op == "measure" and self._measured)
                if not refused:
                    self._running.add(request.name)
                    self._measured = self._measured or request.op == "measure"
            if refused or request is None:
                with contextlib.suppress(OSError):
                    conn.sendall(b'{"error": "not a request the host\'s plan allows (a rank it has, one '
                                 b'measurement), or its process runs already"}\n')
                return
            try:
                self._run(conn, request)
            finally:
                with self._lock:
                    self._running.discard(request.name)

    def _run(self, conn: socket.socket, request: Request) -> None:
        try:
            proc, ends, group = self._spawn(request)
        except (OSError, subprocess.SubprocessError, DeeppoolError) as err:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"error": f"the guest's process did not start: {err}"}).encode() + b"\n")
            return
        try:
            socket.send_fds(conn, [json.dumps({"pid": proc.pid}).encode() + b"\n"], ends)
        except OSError:
            group.kill()  # the host is gone already
        finally:
            for fd in ends:
                os.close(fd)
        self._watch(conn, proc, group)

    def _spawn(self, request: Request) -> tuple[subprocess.Popen, list[int], JobGroup]:
        from deeppool.coordinator.supervisor import enter

        spec = self.spec
        group = JobGroup(self.group.path / f"guest-{spec.job_id}.{request.name}")
        group.create()
        child_in, host_in = os.pipe()
        host_out, child_out = os.pipe()
        write_private(spec.folder / f"guest-{request.name}.json", json.dumps(self._task(request)).encode(),
                      spec.account)
        argv = [sys.executable, "-P", "-m", "deeppool.coordinator.guest", str(spec.folder / f"guest-{request.name}.json")]
        with self._spawning, spec.log.open("ab") as log:  # the log's header and the process's start, one at a time
            log.write(f"$ guest of a foreground job: {request.name}, as {spec.account.name}\n".encode())
            log.flush()
            try:
                proc = subprocess.Popen(argv, stdin=child_in, stdout=child_out, stderr=log, close_fds=True,
                                        env=job_env(spec.account), cwd=spec.folder,
                                        preexec_fn=enter(group, spec.account))
                self.spawned.add(proc.pid)
            finally:
                os.close(child_in)
                os.close(child_out)
        freeze = os.open(group.path / "cgroup.freeze", os.O_WRONLY)
        return proc, [host_in, host_out, freeze], group

    def _task(self, request: Request) -> dict[str, Any]:
        """What the guest's process does: stage the model, then measure it or train as rank ``rank``'s child."""
        from deeppool.multiplex.config import BackgroundConfig, MuxMode
        from deeppool.multiplex.cpu import child_spec

        spec = self.spec
        task: dict[str, Any] = {"op": request.op, "model": spec.model, "roots": [str(r) for r in spec.roots],
                                "stage": str(spec.folder / f"model-{request.name}"), "batch": spec.batch}
        if request.op == "child":
            replica = spec.lent.index(request.rank) if spec.lent else request.rank
            config = BackgroundConfig(model=Path(spec.model), batch=spec.batch, mode=MuxMode.GATE,
                                      checkpoint_dir=spec.folder / "background")
            task["child"] = {**child_spec(config, rank=replica, stats=Path(os.devnull)), "stats": None}
            if spec.lent:  # it joins a running host: its steps, its progress in its own folder, loaded at once
                task["child"].update(steps=spec.steps, progress=str(replica_progress(spec.folder, replica)),
                                     idle_after_load=True)
        return task

    def _watch(self, conn: socket.socket, proc: subprocess.Popen, group: JobGroup) -> None:
        """Until the process ends: a host's ``kill``, or its going, kills the group; then the exit code is sent."""
        while proc.poll() is None:
            if self._leave_by is not None and time.monotonic() > self._leave_by:
                group.kill()  # it left its host, and its host did not stop it
                proc.wait()
                break
            if not select.select([conn], [], [], 0.1)[0]:
                continue
            message = recv(conn)
            if message == b"" or b"kill" in message:
                group.kill()
                proc.wait()
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"exit": proc.returncode}).encode() + b"\n")
        group.end(nested=True)


def _line(conn: socket.socket, limit: int) -> bytes:
    """The first line a host sent (at most ``limit`` bytes; whatever came if it stopped sooner)."""
    conn.settimeout(30)
    data = b""
    try:
        while b"\n" not in data and len(data) < limit:
            chunk = conn.recv(limit - len(data))
            if not chunk:
                break
            data += chunk
    except OSError:
        return b""
    finally:
        conn.settimeout(None)
    return data.split(b"\n", 1)[0]


# -- the guest's side ------------------------------------------------------------------------------------------
def main() -> None:
    """``python -m deeppool.coordinator.guest TASK.json``: as the guest's account, stage its model, then measure
    it (the estimate on stdout) or train as a rank's background child (statistics on stdout at the end)."""
    task = json.loads(Path(sys.argv[1]).read_text())
    try:
        staged = stage_model(task["model"], tuple(Path(root) for root in task["roots"]), Path(task["stage"]))
        if task["op"] == "measure":
            from deeppool.executor.config import OptimizerConfig
            from deeppool.multiplex.preflight import background_memory

            out = os.dup(1)  # the host's pipe gets the estimate alone; what the model prints goes to the log
            os.dup2(2, 1)
            memory = background_memory(Path(staged), int(task["batch"]), OptimizerConfig())
            os.write(out, json.dumps(memory.__dict__).encode() + b"\n")
            return
    except DeeppoolError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    from deeppool.multiplex.child import run

    sys.exit(run({**task["child"], "model": staged}))


if __name__ == "__main__":
    main()
