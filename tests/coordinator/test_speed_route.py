"""``GET /v1/jobs/{id}/speed``: a job's measured speed points and its resizes, to its owner only."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from deeppool.coordinator.app import ServerSettings, create_app
from deeppool.coordinator.client import Client
from deeppool.coordinator.jobs import JobKind, JobRequest, JobStatus, SpeedPoint
from deeppool.coordinator.store import Store
from deeppool.errors import DeeppoolError

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "examples" / "background_mlp.py"


def test_a_job_s_speed_points_and_resizes_are_read_back_by_its_owner(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    tokens = {name: store.create_token(name) for name in ("alice", "bob")}
    settings = ServerSettings(gpus=4, allowed_roots=(REPO / "examples",), log_dir=tmp_path / "logs")
    http = TestClient(create_app(store, settings))
    alice, bob = (Client("http://test", tokens[name], http=http) for name in ("alice", "bob"))
    job = alice.submit(JobRequest(kind=JobKind.FOREGROUND, model=str(MODEL), gpus=2, batch=32, steps=10))
    assert alice.speed(job.id).points == [] and alice.speed(job.id).resizes == []
    store.transition(job.id, JobStatus.STARTING, "a test")
    store.transition(job.id, JobStatus.RUNNING, "a test")
    points = [SpeedPoint(job_id=job.id, gpus=2, batch=32, iteration_s=0.05, steps=12, gns=40.0),
              SpeedPoint(job_id=job.id, gpus=1, batch=32, iteration_s=0.09, steps=7)]
    for point in points:
        store.record_speed(point)
    change = store.begin_resize(store.job(job.id), 1, 32, "the policy gives it 1 GPU")
    assert change is not None
    speed = alice.speed(job.id)
    assert sorted(speed.points, key=lambda p: p.gpus) == sorted(points, key=lambda p: p.gpus)
    assert [(c.from_gpus, c.to_gpus, c.phase) for c in speed.resizes] == [(2, 1, "STOPPING")]
    with pytest.raises(DeeppoolError, match="403"):
        bob.speed(job.id)
    with pytest.raises(DeeppoolError, match="404"):
        alice.speed(job.id + 1)
