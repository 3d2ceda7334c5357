"""What every test run shares: servers the tests start make no jobs' own file system unless a test asks.

``deeppool serve`` as root gives its jobs' folder a loop-mounted image of a quarter of the database's free
space by default (:mod:`deeppool.coordinator.jobsdisk`); the many servers the tests start, and end by
``kill -9`` too, would each leave one. ``DEEPPOOL_JOBS_DISK_MB=0`` (``serve --jobs-disk-mb``'s variable)
turns it off for the run; ``tests/coordinator/test_jobs_disk.py`` asks for the disk itself.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

JOBS_DISK = "DEEPPOOL_JOBS_DISK_MB"


@pytest.fixture(scope="session", autouse=True)
def no_jobs_disk_unless_asked() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(JOBS_DISK, "0")
        yield
