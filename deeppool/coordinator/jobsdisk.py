"""The jobs' own file system: a preallocated ext4 image, loop-mounted at the jobs' folder (``serve --jobs-disk-mb``).

A root server whose jobs' folder is on the database's file system gives the
jobs a file system of their own (by default, :func:`default_size_mb`; ``serve
--jobs-disk-mb N`` sets its size, 0 none): the image ``FOLDER.img`` beside the folder
takes its whole size from the database's file system once, when it is made
(``posix_fallocate``, then ``mkfs.ext4``), and is mounted at the folder
(``mount -o loop,nodev,nosuid``). A job that fills it fills its image only:
the database's file system keeps its free space. ext4 keeps 5% of the image
for root, so the server's and the supervisors' own files (a job's exit file)
are still written when a job's account has filled the rest.

The image is made once and mounted again by each later start (it holds the
jobs' files and ``state.lock``, so a server of another database is refused as
with any folder). A folder that is mounted already (a server stopped by
``kill -9``) is used as it is. At a stop the server unmounts it unless a
process still uses it (jobs outlive their server, and the next start adopts
them): then it stays mounted, and the next start uses it.

Nothing is mounted when the folder is on another file system than the
database's (``--log-dir`` chosen by the operator); nor where it cannot be: not
root, no ``mkfs.ext4`` or loop device, a folder that holds files already (they
would be hidden), or an image that will not mount. Then the server starts as
without the option, with one line saying why.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from deeppool.errors import DeeppoolError

UNMOUNT_S = 1.0
"""How long a stop tries to unmount a jobs' disk that is busy (within the stop's own deadline)."""
RESERVED_PERCENT = 5
"""The share of the image ext4 keeps for root: the server's own files still fit once a job filled the rest."""
DEFAULT_SHARE = 4
"""A jobs' disk made by default takes one part in this many of the database's file system's free space."""
DEFAULT_MIN_MB = 256
"""Under this size no jobs' disk is made by default: the database's file system has too little room to split."""


@dataclass(frozen=True, kw_only=True)
class JobsDisk:
    """What the start did with the jobs' folder: ``mounted`` (its image is mounted at the folder now: the stop
    unmounts it), ``made`` (the image was made by this start), ``detail`` (one line: what was done, or why
    nothing was), ``seconds``."""

    folder: Path
    image: Path
    mounted: bool
    made: bool
    detail: str
    seconds: float


def image_of(folder: Path) -> Path:
    return folder.with_name(folder.name + ".img")


def mounted_from(folder: Path) -> str | None:
    """What is mounted at ``folder`` (its source: a device, for a loop mount ``/dev/loopN``), or None when it is
    not a mount point, from this process's mount table (the last mount there is the one seen)."""
    real = os.path.realpath(folder)
    try:
        table = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return "unknown" if os.path.ismount(real) else None
    found = None
    for line in table.splitlines():
        fields = line.split()
        if _unescape(fields[4]) == real and " - " in line:
            found = _unescape(line.split(" - ", 1)[1].split()[1])
    return found


def backing_file(device: str) -> Path | None:
    """The file a loop device reads (None: not a loop device, or none)."""
    name = Path(device).name
    if not name.startswith("loop"):
        return None
    try:
        return Path(Path(f"/sys/block/{name}/loop/backing_file").read_text().strip())
    except OSError:
        return None


def _unescape(field: str) -> str:
    """A mountinfo path: spaces and tabs as octal escapes."""
    return field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


def default_size_mb(folder: Path, db: Path) -> int:
    """The size of the jobs' disk a root server gives ``folder`` unless told: its image's, once made; else a
    quarter of the free space of ``db``'s file system now (0: less than :data:`DEFAULT_MIN_MB`, none is made)."""
    image = image_of(folder.resolve())
    if image.is_file():
        return image.stat().st_size >> 20
    info = os.statvfs(db.resolve().parent)
    size = (info.f_bavail * info.f_frsize >> 20) // DEFAULT_SHARE
    return size if size >= DEFAULT_MIN_MB else 0


def same_file_system(folder: Path, db: Path) -> bool:
    return os.stat(folder).st_dev == os.stat(db.resolve().parent).st_dev


def mount_jobs_disk(folder: Path, db: Path, size_mb: int) -> JobsDisk:
    """Give the jobs' ``folder`` (existing) a file system of its own of ``size_mb`` MiB, as the module says; never
    raises for what the machine lacks (the result says what was done)."""
    began = time.perf_counter()
    image = image_of(folder)

    def result(detail: str, *, mounted: bool = False, made: bool = False) -> JobsDisk:
        return JobsDisk(folder=folder, image=image, mounted=mounted, made=made, detail=detail,
                        seconds=time.perf_counter() - began)

    source = mounted_from(folder)
    if source is not None:
        ours = backing_file(source) == image.resolve()  # mounted by a start before (stopped by kill -9)
        return result(f"the jobs' folder {folder} is mounted already ({image if ours else source}): used as it is",
                      mounted=ours)
    if not same_file_system(folder, db):
        return result(f"the jobs' folder {folder} is on another file system than the database's: nothing mounted")
    if os.geteuid() != 0:
        return result("not root: the jobs' folder stays on the database's file system (--jobs-disk-mb needs root)")
    if any(folder.iterdir()):
        return result(f"the jobs' folder {folder} holds files already (mounting would hide them): it stays on the "
                      "database's file system; move them out to mount it")
    made = False
    if not image.exists():
        try:
            _make(image, size_mb)
        except DeeppoolError as err:
            image.unlink(missing_ok=True)
            return result(f"{err}: the jobs' folder stays on the database's file system")
        made = True
    mounted = _run(["mount", "-o", "loop,nodev,nosuid", str(image), str(folder)])
    if mounted is not None:
        return result(f"cannot mount {image} at {folder} ({mounted}): the jobs' folder stays on the database's "
                      "file system", made=made)
    os.chmod(folder, 0o711)  # the file system's root: job accounts pass through it to their folders
    size = os.statvfs(folder)
    return result(f"the jobs' folder {folder} is its own file system ({image}, {size.f_blocks * size.f_frsize >> 20} "
                  f"MiB{', made now' if made else ''})", mounted=True, made=made)


def _make(image: Path, size_mb: int) -> None:
    """The image, its whole size taken now, formatted ext4 (only root may read it)."""
    try:
        fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError as err:
        raise DeeppoolError(f"cannot create {image} ({err.strerror})") from None
    try:
        os.posix_fallocate(fd, 0, size_mb << 20)
    except OSError as err:
        raise DeeppoolError(f"cannot take {size_mb} MiB for {image} ({err.strerror})") from None
    finally:
        os.close(fd)
    failed = _run(["mkfs.ext4", "-q", "-F", "-m", str(RESERVED_PERCENT), "-E",
                   "lazy_itable_init=1,lazy_journal_init=1,nodiscard,root_owner=0:0", str(image)])
    if failed is not None:
        raise DeeppoolError(f"cannot format {image} ({failed})")


def _run(command: list[str]) -> str | None:
    """None when ``command`` succeeded; else its last line of error (or why it could not run)."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    if done.returncode == 0:
        return None
    lines = (done.stderr or done.stdout).strip().splitlines()
    return lines[-1] if lines else f"{command[0]} exited with code {done.returncode}"


def unmount_jobs_disk(disk: JobsDisk) -> str:
    """At a stop: unmount what this start mounted, unless a process still uses it. One line: what was done."""
    if not disk.mounted:
        return ""
    deadline = time.monotonic() + UNMOUNT_S
    while (busy := _run(["umount", str(disk.folder)])) is not None and time.monotonic() < deadline:
        time.sleep(0.1)  # a job's step that just ended: its mount namespace goes a moment after it
    if busy is None:
        return f"the jobs' disk {disk.image} is unmounted"
    return f"the jobs' disk stays mounted at {disk.folder} ({busy}): the next start uses it"
