"""A job grown from 1 GPU to a 2-GPU data-parallel plan resumes: the 1-GPU checkpoint has no 2-GPU group's
shard, so each rank reads its tensors by name from the groups it has (the replay's pollux runs found it)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from deeppool.coordinator.jobs import JobKind, JobRequest, JobStatus
from deeppool.coordinator.store import Store
from deeppool.scheduling.scripted import ScriptedResizes
from tests.coordinator.test_elastic import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # real ranks and a resize: about a minute on 2 busy cores
REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "benchmarks" / "replay_models" / "recurrent.py"


def test_a_job_grown_from_one_gpu_to_a_data_parallel_plan_resumes_and_finishes(tmp_path: Path) -> None:
    store = Store(tmp_path / "deeppool.db")
    store.create_token("alice")
    grown, _ = store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model=str(MODEL), gpus=1, batch=16,
                                                steps=80))
    alone, _ = store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model=str(MODEL), gpus=1, batch=16,
                                                steps=80))
    store.close()
    cluster = Cluster.make(tmp_path, ScriptedResizes(job_id=grown.id, widths=[2]), gpus=3)
    cluster.run_until(lambda: all(cluster.store.job(j).state.terminal for j in (grown.id, alone.id)), timeout_s=600)
    events = [e.reason for e in cluster.store.events(grown.id)]
    job, (change,) = cluster.store.job(grown.id), cluster.store.resizes(grown.id)
    assert job.state is JobStatus.SUCCEEDED and job.held == 2, events
    assert (change.from_gpus, change.to_gpus, change.phase) == (1, 2, "DONE"), events
    resumed, unresized = cluster.losses(grown.id), cluster.losses(alone.id)
    assert min(resumed) == change.steps_done and max(resumed) == 79
    for step, loss in resumed.items():  # data parallel on 2 ranks: the same mean gradient, to float tolerance
        assert math.isclose(loss, unresized[step], rel_tol=1e-4), (step, loss, unresized[step])
