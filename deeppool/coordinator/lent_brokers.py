"""Guests of another account lent to a running host: the server names them, the host's supervisor runs their
brokers.

A background job whose account is not its host's joins the running host
(:mod:`deeppool.coordinator.lending`) through a broker
(:class:`~deeppool.coordinator.guest.Broker`) that the host attempt's
supervisor (root) runs for it, as it runs one for a guest given at the host's
start. The server writes each such guest's :class:`GuestSpec` (its account,
folder, log, model, batch, allowed roots, the host's ranks it was lent and
the steps of each replica) into the attempt's ``job-N.A.brokers.json``: the
server's file, 0600, replaced whole (:func:`write_brokers`), which the host can
neither read nor change. It does so before it writes the guest's loan, which
names the broker's socket, into the host's control file. The supervisor looks
at the file at every turn of its wait (:class:`LentBrokers`, one ``stat``):

* a guest newly named: a broker of its own listens on ``job-N.A.guest-M.sock``
  (0600, the host's account's); the host's ranks that were lent ask it for
  their background process at a step boundary. It starts only the ranks of
  the loan, measures nothing, and runs the process as the guest's account in
  a cgroup nested in the host attempt's, exactly as a broker of the host's
  start does (:mod:`deeppool.coordinator.guest`);
* a guest no longer named (it finished, was cancelled or preempted): its
  broker takes no new request, and what of the guest still runs
  :data:`LEAVE_GRACE_S` later is killed (the host's rank asks it to quit at
  its next step boundary, and it saves its checkpoint first).

The host ends its guests' processes when it ends, as ever: they are in its
attempt's group.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from deeppool.coordinator.guest import Broker, GuestSpec
from deeppool.coordinator.isolation import Account, read_job_file, replace_private
from deeppool.coordinator.jobgroup import JobGroup
from deeppool.errors import DeeppoolError

if TYPE_CHECKING:
    from deeppool.coordinator.supervisor import JobFiles

LEAVE_GRACE_S = 30.0
"""How long a guest that left its host may take to quit (a checkpoint) before its broker kills it."""
MAX_BROKERS_BYTES = 1 << 20
"""The most read of a brokers file."""


def brokers_json(specs: Iterable[GuestSpec]) -> bytes:
    """A brokers file's bytes (guests by job id)."""
    return json.dumps({"guests": [spec.to_json() for spec in sorted(specs, key=lambda spec: spec.job_id)]},
                      indent=1).encode()


def parse_brokers(data: bytes) -> dict[int, GuestSpec] | None:
    """The guests of a brokers file's bytes, by job id; None when they are not a whole brokers file."""
    try:
        specs = [GuestSpec.from_json(item) for item in json.loads(data)["guests"]]
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return None
    return {spec.job_id: spec for spec in specs}


def read_brokers(path: Path) -> dict[int, GuestSpec]:
    """The guests named in the server's brokers file ``path`` (none when there is none, or it is not the
    server's own)."""
    data = read_job_file(path, None, MAX_BROKERS_BYTES)
    return (parse_brokers(data) or {}) if data else {}


def write_brokers(path: Path, specs: Iterable[GuestSpec]) -> None:
    """Replace the brokers file ``path`` with ``specs`` (the server's, 0600: its supervisor reads it)."""
    replace_private(path, brokers_json(specs), None)


class LentBrokers:
    """A host supervisor's brokers of the guests lent its running attempt (see the module's docstring)."""

    def __init__(self, files: JobFiles, *, host: Account | None, group: JobGroup) -> None:
        self.files, self.host, self.group = files, host, group
        self.brokers: dict[int, Broker] = {}  # by guest: those listening
        self._retired: list[Broker] = []  # their processes are still theirs to reap
        self._stamp: tuple[int, int, int] | None = None

    @property
    def spawned(self) -> set[int]:
        """The processes every broker started (the supervisor's reaper leaves them to their broker)."""
        return {pid for broker in [*self.brokers.values(), *self._retired] for pid in broker.spawned}

    def update(self, log: Path) -> None:
        """Start the brokers of guests newly named in the brokers file, retire those of guests no longer named;
        a broker that does not start is said in ``log`` (the host's rank then reports its guest failed)."""
        path = self.files.guest_brokers
        try:
            info = os.stat(path, follow_symlinks=False)
        except OSError:
            return  # none yet: no guest was lent (the file is replaced whole, never removed)
        stamp = (info.st_mtime_ns, info.st_size, info.st_ino)
        if stamp == self._stamp:
            return
        data = read_job_file(path, None, MAX_BROKERS_BYTES)
        specs = parse_brokers(data) if data else None
        if specs is None:
            return
        self._stamp = stamp
        for job_id in [job for job, broker in self.brokers.items() if specs.get(job) != broker.spec]:
            broker = self.brokers.pop(job_id)  # gone, or lent anew (other ranks): its broker is retired
            broker.retire(LEAVE_GRACE_S)
            self._retired.append(broker)
        for job_id, spec in specs.items():
            if job_id not in self.brokers and spec.lent:
                self._start(spec, log)

    def _start(self, spec: GuestSpec, log: Path) -> None:
        broker = Broker(spec, self.files.lent_socket(spec.job_id), host=self.host, group=self.group)
        try:
            broker.start()
        except (OSError, DeeppoolError) as err:
            with contextlib.suppress(OSError), log.open("ab") as out:
                out.write(f"deeppool: the broker of guest job {spec.job_id} did not start: {err}\n".encode())
            return
        self.brokers[spec.job_id] = broker

    def close(self) -> None:
        """The host's steps have ended: no broker takes a request any more (the attempt's end kills the rest)."""
        for broker in self.brokers.values():
            broker.close()
