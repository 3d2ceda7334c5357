"""Running jobs through Slurm: ``deeppool serve --launcher slurm``.

Each attempt becomes one batch job: a script (every argument quoted with
``shlex``, no user text is ever a shell string) that runs the same
supervisor as the local launcher, so the lock, log and exit-code files are
the same and a restarted coordinator recovers Slurm jobs as it recovers local
ones. The coordinator's folder must be visible from the compute nodes (a
shared file system, as Slurm clusters have). ``sbatch --parsable`` gives the
Slurm job id, kept beside the attempt's files; ``squeue`` says whether it is
still queued or running, and the supervisor's exit file how it ended. Stopping
is ``scancel --signal=TERM``, a grace period, then ``scancel``. A root
server with ``--job-user`` submits each attempt as the job's account
(``sbatch --uid --gid``), with the job's environment, never its own: Slurm
runs the job, supervisor included, as that account
(:meth:`SlurmLauncher.launch` says which files it may write).

A job's :class:`~deeppool.coordinator.launcher.Resources` become the batch
script's allocation: ``--nodes N --ntasks-per-node 1`` and, per node,
``--gres=gpu:K`` (GPUs) or ``--cpus-per-task=K`` (CPU slots), K = gpus / N.
The supervisor runs on the first node. With several nodes, the driver plans
there and then, through :func:`run_across`, starts ``deeppool run`` once per
node with ``srun``: ``--nnodes N --nproc K`` and a torchrun rendezvous at the
first node's address as Slurm knows it (``NodeAddr``) on a port free there,
with the Slurm job id as the rendezvous id. Every node writes into the job's
shared run folder (the summary comes from rank 0's node), and srun's output,
each line labelled with its node's task number, goes to the job's log.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from deeppool.coordinator.guest import GuestSpec
from deeppool.coordinator.isolation import Account, job_env, private_dir
from deeppool.coordinator.launcher import SUPERVISOR, LaunchPhase, Observed, Resources
from deeppool.coordinator.supervisor import JobFiles, SupervisorSpec
from deeppool.errors import DeeppoolError

LIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"}


@dataclass(frozen=True, kw_only=True)
class SlurmSettings:
    """``partition``: where jobs go (Slurm's default if None); ``gres``: ask for GPUs, else CPU slots."""

    partition: str | None = None
    gres: bool = False


@dataclass(frozen=True, kw_only=True)
class SlurmAllocation:
    """The nodes a running batch job was given, in Slurm's order, with their addresses (``NodeAddr``)."""

    job_id: str
    nodes: tuple[str, ...]
    addresses: tuple[str, ...]
    cpus_per_task: int | None = None
    """the batch job's ``--cpus-per-task``: srun passes it on explicitly (Slurm 22.05's srun does not)"""

    @classmethod
    def here(cls) -> SlurmAllocation | None:
        """The allocation this process runs in (from ``SLURM_JOB_ID`` and ``SLURM_JOB_NODELIST``), else None."""
        job_id, nodelist = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_JOB_NODELIST")
        if not job_id or not nodelist:
            return None
        nodes = tuple(_scontrol("show", "hostnames", nodelist).split())
        cpus = os.environ.get("SLURM_CPUS_PER_TASK", "")
        return cls(job_id=job_id, nodes=nodes, addresses=tuple(node_address(node) for node in nodes),
                   cpus_per_task=int(cpus) if cpus.isdigit() else None)

    def describe(self) -> str:
        return ", ".join(f"{node} ({address})" for node, address in zip(self.nodes, self.addresses))


def _scontrol(*args: str) -> str:
    done = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise DeeppoolError(f"scontrol {' '.join(args)} failed: {done.stderr.strip()[:200]}")
    return done.stdout


def node_address(node: str) -> str:
    """The address Slurm reaches ``node`` at: its ``NodeAddr`` (the node name when none is set)."""
    for field in _scontrol("show", "node", node, "--oneliner").split():
        if field.startswith("NodeAddr="):
            return field.removeprefix("NodeAddr=")
    return node


def _free_port() -> int:
    """A TCP port free on this machine: the first node, where the rendezvous is hosted."""
    with socket.socket() as probe:
        probe.bind(("", 0))
        return int(probe.getsockname()[1])


def across_argv(allocation: SlurmAllocation, plan: Path, gpus: int, run_args: list[str]) -> list[str]:
    """``srun`` starting ``deeppool run PLAN`` once per node: ``gpus / nodes`` ranks each, one rendezvous.

    The rendezvous is at the first node's ``NodeAddr`` on a port free there (this runs on the first node).
    """
    count = len(allocation.nodes)
    if gpus % count:
        raise DeeppoolError(f"the plan's {gpus} GPUs do not split evenly over the job's {count} nodes: "
                            f"submit with --gpus a multiple of {count}")
    endpoint = f"{allocation.addresses[0]}:{_free_port()}"
    cpus = [f"--cpus-per-task={allocation.cpus_per_task}"] if allocation.cpus_per_task else []
    return ["srun", f"--nodes={count}", f"--ntasks={count}", "--ntasks-per-node=1", *cpus, "--kill-on-bad-exit=1",
            "--label", sys.executable, "-m", "deeppool.cli", "run", str(plan), "--nnodes", str(count),
            "--nproc", str(gpus // count), "--rdzv-endpoint", endpoint, "--rdzv-id", f"slurm-{allocation.job_id}",
            *run_args]


class RunAcrossFailed(DeeppoolError):
    """``srun`` ended with ``exit_code``: a node's ``deeppool run`` failed (its error line is in the log)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def run_across(allocation: SlurmAllocation, plan: Path, gpus: int, run_args: list[str]) -> None:
    """Run the plan over the allocation's nodes; its output goes to this process's (the job log)."""
    argv = across_argv(allocation, plan, gpus, run_args)
    print(f"nodes: {allocation.describe()}; rendezvous at {argv[argv.index('--rdzv-endpoint') + 1]}", flush=True)
    code = subprocess.run(argv, stdin=subprocess.DEVNULL).returncode
    if code != 0:
        raise RunAcrossFailed(f"srun over {allocation.describe()} exited with code {code}", exit_code=code)


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
        self.brokers_guests = False  # the supervisor runs as the job's account: it cannot start another's
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o711)  # jobs' accounts pass through it to their own files, never list it

    def files(self, job_id: int, attempt: int) -> JobFiles:
        return JobFiles(folder=self.folder, job_id=job_id, attempt=attempt, state_dir=True)

    def _id_file(self, job_id: int, attempt: int) -> Path:
        return self.folder / f"job-{job_id}.{attempt}.slurm"

    def slurm_id(self, job_id: int, attempt: int) -> str | None:
        try:
            return self._id_file(job_id, attempt).read_text().strip() or None
        except OSError:
            return None

    def launch(self, job_id: int, attempt: int, steps: list[list[str]], env: dict[str, str] | None = None,
               resources: Resources = Resources(), account: Account | None = None,
               workdir: Path | None = None, guest: GuestSpec | None = None) -> None:
        """Submit the attempt's batch script, as ``account`` when one is given (root's ``sbatch --uid --gid``:
        Slurm runs the job, supervisor and all, as that account), else as this server's user.

        The account's supervisor writes its lock, exit file and Slurm's output in ``job-N.A.d`` (0700, the
        account's) and appends to ``job-N.log``, made for it here (0600, the account's) in this server's folder,
        so it can neither replace the log nor write anywhere else in it. ``sbatch`` gets the job's environment
        (:func:`~deeppool.coordinator.isolation.job_env`), never the server's, and Slurm passes that on.
        """
        if guest is not None:
            raise DeeppoolError("a guest of another account needs the local launcher: its supervisor starts it")
        files = self.files(job_id, attempt)
        for folder in (files.state, workdir):
            if folder is not None:
                private_dir(folder, account)
        if account is not None:
            _log_for(files.log, account)
        SupervisorSpec(job_id=job_id, attempt=attempt, steps=steps, env={}, workdir=workdir).write(files, account)
        script = self.folder / f"job-{job_id}.{attempt}.sbatch"
        script.write_text(self.script(job_id, attempt, env or {}, resources, workdir=workdir))
        who = [] if account is None else [f"--uid={account.uid}", f"--gid={account.gid}"]
        done = subprocess.run(["sbatch", "--parsable", *who, str(script)], capture_output=True, text=True,
                              timeout=60, env={**job_env(account), **(env or {})})
        if done.returncode != 0:
            raise DeeppoolError(f"sbatch refused job {job_id}: {done.stderr.strip()[:300]}")
        self._id_file(job_id, attempt).write_text(done.stdout.strip().split(";")[0] + "\n")

    def script(self, job_id: int, attempt: int, env: dict[str, str], resources: Resources,
               workdir: Path | None = None) -> str:
        """The attempt's batch script: its allocation, then the supervisor (no user text is a shell string)."""
        files = self.files(job_id, attempt)
        slots = f"--gres=gpu:{resources.per_node}" if self.settings.gres else f"--cpus-per-task={resources.per_node}"
        lines = ["#!/bin/sh", f"#SBATCH --job-name=deeppool-{job_id}.{attempt}", f"#SBATCH --nodes={resources.nodes}",
                 "#SBATCH --ntasks-per-node=1", f"#SBATCH {slots}",
                 f"#SBATCH --output={shlex.quote(str(files.state / 'slurm.log'))}"]
        if workdir is not None:
            lines.append(f"#SBATCH --chdir={shlex.quote(str(workdir))}")
        if self.settings.partition:
            lines.append(f"#SBATCH --partition={shlex.quote(self.settings.partition)}")
        lines += [f"export {name}={shlex.quote(value)}" for name, value in env.items()]
        lines.append(shlex.join(["exec", sys.executable, "-P", "-m", SUPERVISOR, str(files.spec)]))
        return "\n".join(lines) + "\n"

    def _state(self, slurm_id: str) -> str | None:
        done = subprocess.run(["squeue", "-h", "-j", slurm_id, "-o", "%T"], capture_output=True, text=True, timeout=30)
        state = done.stdout.strip()
        return state if done.returncode == 0 and state else None

    def observe(self, job_id: int, attempt: int) -> Observed:
        files = self.files(job_id, attempt)
        code = files.exit_code()
        if code is not None:
            return Observed(phase=LaunchPhase.EXITED, exit_code=code)
        slurm_id = self.slurm_id(job_id, attempt)
        if slurm_id is None:
            return Observed(phase=LaunchPhase.NOT_STARTED)
        state = self._state(slurm_id)
        if state in LIVE:
            return Observed(phase=LaunchPhase.RUNNING if files.supervisor_pid() is not None else LaunchPhase.QUEUED)
        code = files.exit_code()
        if code is None:
            return Observed(phase=LaunchPhase.LOST)
        return Observed(phase=LaunchPhase.EXITED, exit_code=code)

    def alive(self, job_id: int, attempt: int) -> bool:
        """Whether Slurm still has the attempt's batch job (queued, running or ending: its cgroups' to end)."""
        slurm_id = self.slurm_id(job_id, attempt)
        return slurm_id is not None and self._state(slurm_id) in LIVE

    def stop(self, job_id: int, attempt: int, grace_s: float = 10.0) -> None:
        slurm_id = self.slurm_id(job_id, attempt)
        if slurm_id is None:
            return
        subprocess.run(["scancel", "--signal=TERM", "--full", slurm_id], capture_output=True, timeout=30)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and self._state(slurm_id) in LIVE:
            time.sleep(0.2)
        subprocess.run(["scancel", slurm_id], capture_output=True, timeout=30)


def _log_for(log: Path, account: Account) -> None:
    """The job's log, made (if new) as a regular file of ``account``'s, 0600: its supervisor appends to it."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    try:
        os.fchown(fd, account.uid, account.gid)
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)
