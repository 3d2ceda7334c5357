"""The session's job account, for servers the tests start as root, and the two submitters' accounts and folder
the isolation tests share (see :mod:`tests.coordinator.accounts`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.coordinator.accounts import (
    ALICE,
    BOB,
    JOB_ACCOUNT,
    accounts,
    can_make_accounts,
    remove_job_folders,
    shared_folder,
)


@pytest.fixture(scope="session", autouse=True)
def job_account() -> Iterator[None]:
    if not can_make_accounts():
        yield
        return
    with accounts(JOB_ACCOUNT):
        yield
    remove_job_folders()


@pytest.fixture(scope="module")
def users() -> Iterator[tuple[str, ...]]:
    """Two submitters' OS accounts (:data:`ALICE`, :data:`BOB`), made for a test module (skipped unless root)."""
    with accounts(ALICE, BOB) as names:
        yield names


@pytest.fixture
def shared() -> Iterator[Path]:
    """The server's folder for one test: the database and the jobs' files (jobs can pass through it)."""
    with shared_folder() as folder:
        yield folder
