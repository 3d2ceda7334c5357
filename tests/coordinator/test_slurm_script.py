"""What a Slurm job asks for, without a Slurm: the batch script's allocation, srun's command line, the refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deeppool.coordinator.driver import DriverSpec, DriverSteps, slurm_allocation
from deeppool.coordinator.jobs import JobKind, JobRequest, JobStatus
from deeppool.coordinator.launcher import LocalLauncher, Resources
from deeppool.coordinator.runtime import Runtime
from deeppool.coordinator.slurm import SlurmAllocation, SlurmLauncher, SlurmSettings, across_argv
from deeppool.coordinator.store import Store
from deeppool.errors import DeeppoolError


def test_a_two_node_job_asks_for_each_nodes_share(tmp_path: Path) -> None:
    gpus = SlurmLauncher(tmp_path, SlurmSettings(partition="gpu", gres=True)).script(3, 1, {}, Resources(gpus=8, nodes=2))
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --gres=gpu:4\n" in gpus
    assert "#SBATCH --partition=gpu\n" in gpus
    cpus = SlurmLauncher(tmp_path).script(3, 1, {}, Resources(gpus=2, nodes=2))
    assert "#SBATCH --cpus-per-task=1\n" in cpus and "--gres" not in cpus


def test_gpus_that_do_not_split_over_the_nodes_are_refused() -> None:
    assert Resources(gpus=8, nodes=2).per_node == 4
    with pytest.raises(DeeppoolError, match="gpus 3 do not split evenly over 2 nodes: ask for a multiple of 2"):
        Resources(gpus=3, nodes=2)


def test_srun_starts_deeppool_run_once_per_node_meeting_at_the_first_nodes_address() -> None:
    allocation = SlurmAllocation(job_id="41", nodes=("gpu-a", "gpu-b"), addresses=("10.1.0.7", "10.1.0.8"))
    argv = across_argv(allocation, Path("plan.json"), 8, ["--steps", "3"])
    assert argv[:5] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    run = argv[argv.index("run"):]
    option = {flag: run[run.index(flag) + 1] for flag in ("--nnodes", "--nproc", "--rdzv-endpoint", "--rdzv-id")}
    assert option["--nnodes"] == "2" and option["--nproc"] == "4" and option["--rdzv-id"] == "slurm-41"
    assert option["--rdzv-endpoint"].startswith("10.1.0.7:") and run[-2:] == ["--steps", "3"]
    with pytest.raises(DeeppoolError, match="plan's 3 GPUs do not split evenly over the job's 2 nodes"):
        across_argv(allocation, Path("plan.json"), 3, [])
    on_cpus = SlurmAllocation(job_id="41", nodes=("a", "b"), addresses=("a", "b"), cpus_per_task=4)
    assert "--cpus-per-task=4" in across_argv(on_cpus, Path("plan.json"), 8, [])[:6]


def test_outside_slurm_there_is_no_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert SlurmAllocation.here() is None


def _runtime(tmp_path: Path) -> Runtime:
    store = Store(tmp_path / "db.sqlite")
    store.create_token("alice")
    return Runtime(store, LocalLauncher(tmp_path / "jobs"), lambda job, attempt, guests: [], nodes=2)


def test_a_foreground_job_spans_the_nodes_and_a_background_job_one(tmp_path: Path) -> None:
    rt = _runtime(tmp_path)
    fg, _ = rt.store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model="x.y:z", gpus=4, batch=8))
    bg, _ = rt.store.submit("alice", JobRequest(kind=JobKind.BACKGROUND, model="x.y:z", batch=8))
    assert rt.resources(fg) == Resources(gpus=4, nodes=2) and rt.resources(bg) == Resources(gpus=1, nodes=1)


def test_a_job_whose_gpus_do_not_split_fails_with_the_reason(tmp_path: Path) -> None:
    rt = _runtime(tmp_path)
    job, _ = rt.store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model="x.y:z", gpus=3, batch=8))
    assert rt.start(job, "granted") is False
    failed = rt.store.job(job.id)
    assert failed.state is JobStatus.FAILED and "ask for a multiple of 2" in failed.reason
    assert rt.launcher.files(job.id, 1).supervisor_pid() is None  # nothing was launched


def test_the_driver_is_told_the_nodes_a_job_spans(tmp_path: Path) -> None:
    rt = _runtime(tmp_path)
    fg, _ = rt.store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model="x.y:z", gpus=4, batch=8))
    bg, _ = rt.store.submit("alice", JobRequest(kind=JobKind.BACKGROUND, model="x.y:z", batch=8))
    steps = DriverSteps(folder=tmp_path / "jobs", nodes=2)
    specs = [DriverSpec.from_json(json.loads(Path(steps(job, 1, [])[0][-1]).read_text())) for job in (fg, bg)]
    assert [spec.nodes for spec in specs] == [2, 1]


def test_a_job_for_several_nodes_outside_a_slurm_allocation_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert slurm_allocation(1) is None
    with pytest.raises(DeeppoolError, match="spans 2 nodes but runs in no Slurm allocation"):
        slurm_allocation(2)
