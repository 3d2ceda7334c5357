"""The jobs' own file system (``serve --jobs-disk-mb``, :mod:`deeppool.coordinator.jobsdisk`): a job that fills it
leaves the database's file system as it was, its record true; a server made it once, mounts it again after a
``kill -9`` and unmounts it at its stop; where it cannot be mounted the server starts without it.

Real mounts (a loop-mounted ext4 image on a small tmpfs), real processes; root only."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from deeppool.coordinator.app import ServerSettings, create_app
from deeppool.coordinator.jobs import JobStatus
from deeppool.coordinator.jobsdisk import default_size_mb, image_of, mount_jobs_disk, mounted_from, unmount_jobs_disk
from deeppool.coordinator.retention import Retention, sweep
from deeppool.coordinator.store import default_log_dir
from tests.conftest import JOBS_DISK
from tests.coordinator.accounts import shared_folder, small_tmpfs
from tests.coordinator.test_durability import start
from tests.coordinator.test_exhaustion import FILL, REPO, Cluster
from tests.net import free_port

pytestmark = pytest.mark.slow


def free(path: Path) -> int:
    info = os.statvfs(path)
    return info.f_bavail * info.f_frsize


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A 48 MiB tmpfs (root only) for the database, its reserve and a 16 MiB jobs' image, unmounted afterwards."""
    with shared_folder() as shared, small_tmpfs(shared, 48) as disk:
        yield disk


@pytest.fixture
def jobs_folder(small_disk: Path) -> Iterator[Path]:
    """The jobs' folder beside the database on ``small_disk`` (0711, as ``serve`` makes it), unmounted afterwards."""
    folder = small_disk / "jobs"
    folder.mkdir(mode=0o711)
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True, check=False)


def test_a_job_filling_its_own_disk_leaves_the_databases_free_space_as_it_was(jobs_folder: Path, small_disk: Path,
                                                                            users) -> None:  # noqa: F811
    disk = mount_jobs_disk(jobs_folder, small_disk / "db.sqlite", 16)
    assert disk.mounted and disk.made, disk.detail
    assert mounted_from(jobs_folder) is not None and image_of(jobs_folder).stat().st_size == 16 << 20
    cluster = Cluster(small_disk)  # its jobs' folder: small_disk/jobs
    retention = Retention(keep_s=None, min_free_bytes=2 << 20)
    http = TestClient(create_app(cluster.store, ServerSettings(gpus=4, allowed_roots=(REPO / "examples",),
                                                               log_dir=jobs_folder, retention=retention)))
    before = free(small_disk)
    job = cluster.run(FILL)
    assert job.state is JobStatus.SUCCEEDED and job.exit_code == 0, (job.reason, cluster.log(job))
    assert "full: No space left on device" in cluster.log(job)
    assert free(jobs_folder) < 1 << 20  # its disk is full; the database's lost only what its own commits took
    assert before - free(small_disk) < 1 << 20, (before, free(small_disk))
    short = http.get("/healthz")
    assert short.status_code == 503 and "the jobs' disk is short" in short.json()["detail"], short.text
    assert sweep(cluster.store, jobs_folder, retention).removed == (job.id,)  # its files go: the jobs' disk has room
    assert http.get("/healthz").json() == {"ok": True}
    cluster.store.close()
    assert unmount_jobs_disk(disk).endswith("is unmounted") and mounted_from(jobs_folder) is None
    again = mount_jobs_disk(jobs_folder, small_disk / "db.sqlite", 16)  # the next start: the same image
    assert again.mounted and not again.made, again.detail


def test_where_it_cannot_be_mounted_the_folder_stays_as_it_was(jobs_folder: Path, small_disk: Path) -> None:
    assert default_size_mb(jobs_folder, small_disk / "db.sqlite") == 0  # a quarter of 48 MiB: too little to split
    image = image_of(jobs_folder)
    image.write_bytes(bytes(1 << 20))  # an image that is no file system
    refused = mount_jobs_disk(jobs_folder, small_disk / "db.sqlite", 16)
    assert not refused.mounted and "cannot mount" in refused.detail and "\n" not in refused.detail
    assert mounted_from(jobs_folder) is None
    image.unlink()
    (jobs_folder / "job-1.log").write_text("an earlier job's log")
    kept = mount_jobs_disk(jobs_folder, small_disk / "db.sqlite", 16)
    assert not kept.mounted and "holds files already" in kept.detail and not image.exists()
    (small_disk / "elsewhere").mkdir()
    elsewhere = mount_jobs_disk(small_disk / "elsewhere", REPO / "pyproject.toml", 16)  # not the database's
    assert not elsewhere.mounted and "another file system" in elsewhere.detail


@pytest.mark.heavy  # two server starts
def test_serve_makes_its_jobs_disk_once_uses_it_after_a_kill_9_and_unmounts_it_at_its_stop(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("a loop mount needs root")
    db, port = tmp_path / "db.sqlite", free_port()
    folder = default_log_dir(db)
    options = ("--jobs-disk-mb", "16")  # keeping 2 MiB free (an eighth)
    try:
        first = start(db, port, paused=True, job_user=False, options=options)
        first.kill()
        first.wait(10)
        assert "made now" in first.stderr.read().decode()
        assert mounted_from(folder) is not None  # a kill -9 leaves it mounted
        second = start(db, port, paused=True, job_user=False, options=options)
        second.send_signal(signal.SIGTERM)
        assert second.wait(15) == 0
        said = second.stderr.read().decode()
        assert "mounted already" in said and "is unmounted" in said, said
        assert mounted_from(folder) is None and image_of(folder).stat().st_size == 16 << 20
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True, check=False)


def test_a_root_server_gives_its_jobs_a_quarter_of_the_databases_free_space_unless_told() -> None:
    with shared_folder() as shared, small_tmpfs(shared, 1200) as disk:
        db, folder = disk / "db.sqlite", default_log_dir(disk / "db.sqlite")
        quarter = (free(disk) >> 20) // 4
        try:
            server = start(db, free_port(), paused=True, job_user=False, env={JOBS_DISK: ""})  # no setting: default
            server.send_signal(signal.SIGTERM)
            assert server.wait(15) == 0
            said = server.stderr.read().decode()
            assert "made now); by default a quarter" in said and "is unmounted" in said, said
            assert image_of(folder).stat().st_size >> 20 == quarter and mounted_from(folder) is None
            assert default_size_mb(folder, db) == quarter  # the next start mounts the image it made
            off = start(db, free_port(), paused=True, job_user=False, env={JOBS_DISK: "0"})
            off.send_signal(signal.SIGTERM)
            assert off.wait(15) == 0 and "jobs' folder" not in off.stderr.read().decode()
            assert mounted_from(folder) is None and (folder / "state.lock").is_file()  # on the database's
        finally:
            subprocess.run(["umount", str(folder)], capture_output=True, check=False)


def test_serve_refuses_a_jobs_disk_that_cannot_hold_with_one_line(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from tests.entry import deeppool

    for options, says in ((("--jobs-disk-mb", "4"), "must be at least 8 (or 0: none)"),
                          (("--jobs-disk-mb", "64", "--min-free-mb", "64"), "more than --min-free-mb 64"),
                          (("--jobs-disk-mb", "64", "--launcher", "slurm"), "is for --launcher local")):
        refused = deeppool(capsys, "serve", "--db", str(tmp_path / "d.db"), "--paused", *options)
        assert refused.code == 2 and refused.stderr.startswith("error: --jobs-disk-mb") and says in refused.stderr
        assert len(refused.stderr.splitlines()) == 1
    assert not list(tmp_path.iterdir())  # nothing was created
