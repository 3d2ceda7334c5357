"""Running jobs through Slurm: ``deeppool serve --launcher slurm``.

Each attempt becomes one batch job: a script (every argument quoted with
``shlex``, no user text is ever a shell string) that runs the same
supervisor as the local launcher, so the lock, log and exit-code files are
the same and a restarted coordinator recovers Slurm jobs as it recovers local
ones. The coordinator's folder must be visible from the compute nodes (a
shared file system, as Slurm clusters have). ``sbatch --parsable`` gives the
Slurm job id, kept beside the attempt's files; ``squeue`` says whether it is
still queued or running, and the supervisor's exit file how it ended. Stopping
is ``scancel --signal=TERM``, a grace period, then ``scancel``.

A job gets one node (``--nodes=1``): the executor launches its ranks on one
host, and asking ``--gres=gpu:N`` per job is still to come. Spreading a plan's ranks
over several nodes with a torchrun rendezvous needs the executor's multi-node
launch, which does not exist yet.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from deeppool.coordinator.launcher import SUPERVISOR, Observed, Phase
from deeppool.coordinator.supervisor import JobFiles
from deeppool.errors import DeeppoolError

LIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}


@dataclass(frozen=True, kw_only=True)
class SlurmSettings:
    partition: str | None = None


def check_slurm() -> None:
    """Refuse ``--launcher slurm`` where Slurm's client tools or its controller are not reachable."""
    for tool in ("sbatch", "squeue", "scancel"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            raise DeeppoolError(f"--launcher slurm needs Slurm's `{tool}` on PATH: install slurm-client")
    ping = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30)
    if ping.returncode != 0:
        raise DeeppoolError(f"--launcher slurm: Slurm's controller does not answer ({ping.stderr.strip()[:200]})")


class SlurmLauncher:
    def __init__(self, folder: Path, settings: SlurmSettings = SlurmSettings()) -> None:
        self.folder, self.settings = folder, settings
        folder.mkdir(parents=True, exist_ok=True)

    def files(self, job_id: int, attempt: int) -> JobFiles:
        return JobFiles(folder=self.folder, job_id=job_id, attempt=attempt)

    def _id_file(self, job_id: int, attempt: int) -> Path:
        return self.folder / f"job-{job_id}.{attempt}.slurm"

    def slurm_id(self, job_id: int, attempt: int) -> str | None:
        try:
            return self._id_file(job_id, attempt).read_text().strip() or None
        except OSError:
            return None

    def launch(self, job_id: int, attempt: int, steps: list[list[str]], env: dict[str, str] | None = None) -> None:
        import json

        files = self.files(job_id, attempt)
        tmp = files.spec.with_name(files.spec.name + ".tmp")
        tmp.write_text(json.dumps({"job_id": job_id, "attempt": attempt, "steps": steps}))
        os.replace(tmp, files.spec)
        script = self.folder / f"job-{job_id}.{attempt}.sbatch"
        script.write_text(self._script(job_id, attempt, files, env or {}))
        done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise DeeppoolError(f"sbatch refused job {job_id}: {done.stderr.strip()[:300]}")
        self._id_file(job_id, attempt).write_text(done.stdout.strip().split(";")[0] + "\n")

    def _script(self, job_id: int, attempt: int, files: JobFiles, env: dict[str, str]) -> str:
        lines = ["#!/bin/sh", f"#SBATCH --job-name=deeppool-{job_id}.{attempt}", "#SBATCH --nodes=1",
                 f"#SBATCH --output={shlex.quote(str(self.folder / f'job-{job_id}.{attempt}.slurm.log'))}"]
        if self.settings.partition:
            lines.append(f"#SBATCH --partition={shlex.quote(self.settings.partition)}")
        lines += [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
        lines.append(shlex.join(["exec", sys.executable, "-m", SUPERVISOR, str(files.spec)]))
        return "\n".join(lines) + "\n"

    def _state(self, slurm_id: str) -> str | None:
        done = subprocess.run(["squeue", "-h", "-j", slurm_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
        state = done.stdout.strip()
        return state if done.returncode == 0 and state else None

    def observe(self, job_id: int, attempt: int) -> Observed:
        files = self.files(job_id, attempt)
        code = files.exit_code()
        if code is not None:
            return Observed(phase=Phase.EXITED, exit_code=code)
        slurm_id = self.slurm_id(job_id, attempt)
        if slurm_id is None:
            return Observed(phase=Phase.NOT_STARTED)
        state = self._state(slurm_id)
        if state in LIVE:
            return Observed(phase=Phase.RUNNING if files.supervisor_pid() is not None else Phase.QUEUED)
        code = files.exit_code()
        return Observed(phase=Phase.EXITED, exit_code=code) if code is not None else Observed(phase=Phase.LOST)

    def stop(self, job_id: int, attempt: int, grace_s: float = 10.0) -> None:
        slurm_id = self.slurm_id(job_id, attempt)
        if slurm_id is None:
            return
        subprocess.run(["scancel", "--signal=TERM", "--full", slurm_id], capture_output=True, timeout=30)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self._state(slurm_id) in LIVE:
            time.sleep(0.2)
        subprocess.run(["scancel", slurm_id], capture_output=True, timeout=30)
