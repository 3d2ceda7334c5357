"""A job's supervisor: ``python -m deeppool.coordinator.supervisor SPEC.json``, in its own process session.

The coordinator starts one per attempt at a job (a background job that was
preempted and requeued runs again as its next attempt) and does not wait for
it, so a restart of the coordinator does not touch running jobs. The
supervisor first creates ``job-N.A.pid`` with ``O_EXCL``: that file is the
attempt's launch lock, so an attempt never runs twice, even if two supervisors
were started for it. It then runs the job's steps (argv lists, never a shell)
one after the other with their output appended to ``job-N.log``, and stops at
the first that fails. It forwards SIGTERM to the running step, and finally
writes the exit code to ``job-N.A.exit`` atomically (a temporary file, then
``os.replace``). A restarted coordinator finalises the job from that file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import FrameType


@dataclass(frozen=True, kw_only=True)
class JobFiles:
    folder: Path
    job_id: int
    attempt: int

    def _path(self, suffix: str) -> Path:
        return self.folder / f"job-{self.job_id}.{self.attempt}.{suffix}"

    @property
    def spec(self) -> Path:
        return self._path("json")

    @property
    def pid(self) -> Path:
        return self._path("pid")

    @property
    def exit(self) -> Path:
        return self._path("exit")

    @property
    def log(self) -> Path:
        return self.folder / f"job-{self.job_id}.log"

    def exit_code(self) -> int | None:
        try:
            return int(self.exit.read_text().strip())
        except (OSError, ValueError):
            return None

    def supervisor_pid(self) -> int | None:
        try:
            return int(self.pid.read_text().strip())
        except (OSError, ValueError):
            return None


def _write_exit(files: JobFiles, code: int) -> None:
    tmp = files.exit.with_name(files.exit.name + ".tmp")
    tmp.write_text(f"{code}\n")
    os.replace(tmp, files.exit)


def run(files: JobFiles) -> int:
    try:
        fd = os.open(files.pid, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return 0  # another supervisor owns this job: never run it twice
    os.write(fd, f"{os.getpid()}\n".encode())
    os.close(fd)
    steps: list[list[str]] = json.loads(files.spec.read_text())["steps"]
    current: list[subprocess.Popen] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        del frame
        for proc in current:
            proc.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    code = 0
    with files.log.open("ab") as log:
        for argv in steps:
            log.write(f"$ {' '.join(argv)}\n".encode())
            log.flush()
            current[:] = [subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)]
            code = current[0].wait()
            if code != 0:
                break
    _write_exit(files, code)
    return code


def main() -> None:
    spec = Path(sys.argv[1])
    data = json.loads(spec.read_text())
    files = JobFiles(folder=spec.parent, job_id=int(data["job_id"]), attempt=int(data["attempt"]))
    sys.exit(0 if run(files) == 0 else 1)


if __name__ == "__main__":
    main()
