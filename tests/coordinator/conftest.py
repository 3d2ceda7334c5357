"""The session's job account, for servers the tests start as root (see :mod:`tests.coordinator.accounts`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.coordinator.accounts import JOB_ACCOUNT, accounts, can_make_accounts, remove_job_folders


@pytest.fixture(scope="session", autouse=True)
def job_account() -> Iterator[None]:
    if not can_make_accounts():
        yield
        return
    with accounts(JOB_ACCOUNT):
        yield
    remove_job_folders()
