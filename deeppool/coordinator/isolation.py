"""What keeps a job away from the server, from other jobs and from their files: accounts, environment, files.

* **Accounts.** ``deeppool serve --job-user submitter`` runs each job as the OS
  account named like its owner's token (as Slurm runs a job as its submitter);
  ``--job-user ACCOUNT`` runs every job as one dedicated account. The server
  (root) starts each job's supervisor, which enters the job's cgroup, drops to
  the account (groups, gid, uid, then ``no_new_privs``) and runs the steps.
  An account is never root and never the server's own user.
* **Environment.** A job's environment is built from an allow-list
  (:data:`ALLOWED`, :data:`ALLOWED_PREFIXES`), never copied: the server's
  secrets and tokens stay with the server.
* **Files.** The server's files are created with umask 077 (the database
  0600); the launcher's folder is 0711 (others may pass through it, not list
  it) and every job's own folder is 0700, owned by its account. Whatever a job
  wrote is read by the server only through :func:`read_job_file`: never
  through a symbolic link, and only when the job's account owns it, so a job
  cannot make the server read a file the job could not read itself.
* **Model files.** :func:`stage_model` runs in the job, as its account: it
  opens the model file once, checks the file it opened (by its descriptor's
  real path) is still under the allowed roots, and copies those bytes into the
  job's folder; the copy is what the job imports.
"""

from __future__ import annotations

import enum
import errno
import os
import pwd
import stat
from dataclasses import dataclass
from pathlib import Path

from deeppool.errors import DeeppoolError

ALLOWED = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TERM", "PYTHONPATH", "PYTHONHASHSEED",
           "DEEPPOOL_FAULT")
"""Variables a job inherits from the server, by name (a job with an account of its own gets its ``HOME``,
``USER`` and ``LOGNAME``)."""
ALLOWED_PREFIXES = ("LC_", "CUDA_", "NCCL_", "GLOO_", "OMP_", "MKL_", "SLURM_", "TORCH_")
"""Variables a job inherits from the server, by prefix (locale, devices, collectives, threads, Slurm)."""
MAX_JOB_FILE = 64 << 20
"""The most the server reads of one file a job wrote."""


class AccountError(DeeppoolError):
    """A job's OS account is missing or unfit; the message names the account."""


SHORTAGE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
"""Errors that say the server lacks a resource now (descriptors, memory), not that a fact is absent. Never
EAGAIN: a job's lease on its own file makes the server's non-blocking open fail with it, and no job may stall
every tick."""


class ModelRefused(DeeppoolError):
    """A model file refused at launch; ``why`` is one of :data:`REFUSALS`' keys (the job's public reason says
    which, never the path: the status page shows reasons to anyone)."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


REFUSED = "refused.json"
"""In the job's folder: why its model was refused at launch (``{"why": KEY}``, a key of :data:`REFUSALS`)."""
REFUSALS = {"unopenable": "its model file could not be opened at launch",
            "irregular": "its model file was not a regular file at launch",
            "outside": "its model file resolved outside the server's allowed roots at launch"}


class ServerShortage(Exception):  # not a DeeppoolError, so no job is failed for it
    """The server cannot read a fact now (no descriptors, no memory): the caller retries later and never
    records an absence (a lost job, a missing account) from it. The scheduling loop retries its tick."""


def shortage(err: OSError) -> bool:
    """Whether ``err`` is the server's shortage (retry later) rather than an answer about the file."""
    return err.errno in SHORTAGE_ERRNOS


@dataclass(frozen=True, kw_only=True)
class Account:
    """An OS account a job runs as."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    @classmethod
    def named(cls, name: str) -> Account:
        """The account ``name``; refused when it does not exist, is root or is this server's own user."""
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            _passwd_readable()  # an account database the server cannot read now says nothing of the account
            raise AccountError(f"no OS account '{name}' to run the job as: create it (useradd --system "
                                f"{name}) or serve with another --job-user") from None
        if entry.pw_uid == 0 or entry.pw_uid == os.geteuid():
            raise AccountError(f"account '{name}' is root or the server's own user: jobs must run as an "
                                "unprivileged account of their own")
        groups = tuple(sorted(set(os.getgrouplist(name, entry.pw_gid))))
        return cls(name=name, uid=entry.pw_uid, gid=entry.pw_gid, groups=groups, home=entry.pw_dir)

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "uid": self.uid, "gid": self.gid, "groups": list(self.groups), "home": self.home}

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Account:
        groups = data["groups"]
        assert isinstance(groups, list)
        return cls(name=str(data["name"]), uid=int(str(data["uid"])), gid=int(str(data["gid"])),
                   groups=tuple(int(g) for g in groups), home=str(data["home"]))


def _passwd_readable() -> None:
    """Raise :class:`ServerShortage` when the account database cannot be read now (no descriptors)."""
    try:
        os.close(os.open("/etc/passwd", os.O_RDONLY | os.O_CLOEXEC))
    except OSError as err:
        raise ServerShortage(f"the account database cannot be read now: {err.strerror}") from None


class RunAsKind(enum.Enum):
    SERVER = "server"  # jobs run as the server's user: a personal server, no isolation from it
    SUBMITTER = "submitter"  # each job as the account named like its owner
    ACCOUNT = "account"  # every job as one dedicated account


@dataclass(frozen=True, kw_only=True)
class RunAs:
    """Who a job runs as (``serve --job-user``)."""

    kind: RunAsKind = RunAsKind.SERVER
    account_name: str | None = None

    @classmethod
    def parse(cls, job_user: str | None) -> RunAs:
        """``None`` (the server's user), ``submitter``, or an account name (checked now)."""
        if job_user is None:
            return cls()
        if job_user == RunAsKind.SUBMITTER.value:
            return cls(kind=RunAsKind.SUBMITTER)
        Account.named(job_user)
        return cls(kind=RunAsKind.ACCOUNT, account_name=job_user)

    def account(self, owner: str) -> Account | None:
        """The account ``owner``'s jobs run as (None: the server's user); a one-line error if there is none."""
        if self.kind is RunAsKind.SERVER:
            return None
        return Account.named(owner if self.kind is RunAsKind.SUBMITTER else str(self.account_name))

    def same_account(self, first: str, second: str) -> bool:
        """Whether two owners' jobs run as the same account (else a guest is started by its host's broker)."""
        return self.kind is not RunAsKind.SUBMITTER or first == second


def closed_to_others(path: Path) -> Path | None:
    """The first of ``path``'s existing folders (from the root down), or ``path`` itself, other users
    cannot pass through (no o+x); None when an account of its own reaches it."""
    for step in [*reversed(path.parents), path]:
        if step.exists() and not os.stat(step).st_mode & 0o001:
            return step
    return None


def job_env(account: Account | None, source: dict[str, str] | None = None) -> dict[str, str]:
    """A job's environment: the allowed variables of ``source`` (the server's), the account's identity."""
    given = os.environ if source is None else source
    env = {k: v for k, v in given.items() if k in ALLOWED or k.startswith(ALLOWED_PREFIXES)}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    if account is not None:
        env.update(HOME=account.home, USER=account.name, LOGNAME=account.name)
    return env


def private_dir(path: Path, account: Account | None) -> None:
    """``path`` a real folder (never a link), mode 0700, owned by ``account`` (else the server's user)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise DeeppoolError(f"'{path}' is not a folder: the job's folder must be one")
    if account is not None:
        os.lchown(path, account.uid, account.gid)
    os.chmod(path, 0o700, follow_symlinks=False)


def write_private(path: Path, data: bytes, account: Account | None) -> None:
    """Write ``path`` afresh (never through a link), mode 0600, owned by ``account`` (else the server's user)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, data)
        if account is not None:
            os.fchown(fd, account.uid, account.gid)
    finally:
        os.close(fd)


def replace_private(path: Path, data: bytes, account: Account | None) -> None:
    """Replace ``path`` at once (a temporary file beside it, then a rename): as :func:`write_private`, but a
    reader that watches it (a host's ranks, a supervisor) never finds it missing or half-written."""
    tmp = path.with_name(path.name + ".tmp")
    write_private(tmp, data, account)
    os.replace(tmp, path)


def private_file(path: Path) -> None:
    """Make the server's file ``path`` (and its SQLite companions) readable by the server's user only."""
    for name in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            os.chmod(name, 0o600)
        except OSError:
            pass


def read_job_file(path: Path, owner: int | None, limit: int = MAX_JOB_FILE, *,
                  any_owner: bool = False) -> bytes | None:
    """A file a job wrote: not through a link, a regular file (never a FIFO to block on), owned by ``owner``
    (a uid; None: the server's; ``any_owner``: either), else None. Raises :class:`ServerShortage` when the
    server cannot open it now (no descriptors, no memory): that says nothing of the file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        if shortage(err):  # not an answer: the caller retries later
            raise ServerShortage(f"'{path}' cannot be read now: {err.strerror}") from None
        return None
    try:
        info = os.fstat(fd)
        mine = info.st_uid == (os.geteuid() if owner is None else owner)
        if not stat.S_ISREG(info.st_mode) or not (mine or any_owner):
            return None
        chunks, left = [], limit
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def stage_model(model: str, roots: tuple[Path, ...], folder: Path) -> str:
    """The model the job runs: a factory name as given, or a checked copy of the model file in ``folder``.

    The file is opened once; the path the descriptor really names must lie under one of ``roots``, and
    the bytes read from that descriptor are what is written to ``folder`` (0600) and later imported.
    """
    if not model.endswith(".py"):
        return model
    try:
        fd = os.open(model, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        raise ModelRefused(f"model file '{model}' cannot be opened at launch: {err.strerror}", "unopenable") from None
    try:
        real = Path(os.readlink(f"/proc/self/fd/{fd}"))
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ModelRefused(f"model '{model}' is not a regular file at launch", "irregular")
        if roots and not any(real.is_relative_to(root) for root in roots):
            raise ModelRefused(f"model '{model}' is '{real}' at launch, outside the server's allowed roots", "outside")
        data = b""
        while chunk := os.read(fd, 1 << 20):
            data += chunk
    finally:
        os.close(fd)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    copy = folder / Path(model).name
    write_private(copy, data, None)
    return str(copy.resolve())
