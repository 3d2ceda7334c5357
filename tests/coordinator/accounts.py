"""OS accounts for the coordinator's tests (created with useradd, removed afterwards), and folders they reach.

A server started as root must run its jobs as an account of their own
(``serve --job-user``): :data:`JOB_ACCOUNT`, made for the session by
``tests/coordinator/conftest.py``, with the jobs' files in a folder of
:func:`job_folder`. The Python running the tests must be reachable by that
account: the folders above it are opened to others (o+x) for the session.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

JOB_ACCOUNT = "dpjobs"
ALICE, BOB = "dpalice", "dpbob"
"""The submitters of the isolation tests (:func:`tests.coordinator.conftest.users`)."""


def can_make_accounts() -> bool:
    return os.geteuid() == 0 and shutil.which("useradd") is not None


@contextmanager
def accounts(*names: str) -> Iterator[tuple[str, ...]]:
    """Unprivileged accounts ``names`` for the duration (skips where this process cannot create them)."""
    if not can_make_accounts():
        pytest.skip("creating job accounts needs root and useradd")
    made = []
    # the interpreter as jobs start it (a venv's bin/python, e.g. in a clone under a private mkdtemp folder)
    # and the one it links to (e.g. a Python under /root)
    opened = _open_to_others(dict.fromkeys([*Path(sys.executable).parents,
                                            *Path(os.path.realpath(sys.executable)).parents]))
    try:
        for name in names:
            try:
                pwd.getpwnam(name)
            except KeyError:
                subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
                               check=True, capture_output=True)
                made.append(name)
        yield names
    finally:
        for name in made:
            subprocess.run(["userdel", name], capture_output=True)
        for folder, mode in opened:
            folder.chmod(mode)


def _open_to_others(folders: Iterable[Path]) -> list[tuple[Path, int]]:
    """Let other users pass through ``folders``; the modes they had, to restore."""
    opened = []
    for folder in folders:
        mode = folder.stat().st_mode & 0o7777
        if not mode & 0o001:
            folder.chmod(mode | 0o001)
            opened.append((folder, mode))
    return opened


@contextmanager
def shared_folder() -> Iterator[Path]:
    """A fresh folder other users can pass through (0711), removed afterwards.

    Not under pytest's ``tmp_path``: pytest makes its base folder 0700 again whenever a session starts.
    """
    folder = Path(tempfile.mkdtemp(prefix="deeppool-jobs-"))
    folder.chmod(0o711)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def small_tmpfs(folder: Path, mib: int) -> Iterator[Path]:
    """A ``mib`` MiB tmpfs at ``folder/disk`` (0711; root only: skipped otherwise), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    disk = folder / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0711", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _jobs_base() -> Path:
    return Path(tempfile.gettempdir()) / f"deeppool-test-jobs-{os.getpid()}"


def job_folder() -> Path:
    """A fresh folder for a server's job files that job accounts can pass through (removed with the session)."""
    base = _jobs_base()
    base.mkdir(exist_ok=True)
    base.chmod(0o711)
    folder = Path(tempfile.mkdtemp(dir=base))
    folder.chmod(0o711)
    return folder


def remove_job_folders() -> None:
    shutil.rmtree(_jobs_base(), ignore_errors=True)
