"""``GET /metrics``: jobs by state, queue length, GPUs busy and lent, in Prometheus' format, without a token."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from deeppool.coordinator.app import ServerSettings, create_app
from deeppool.coordinator.jobs import JobKind, JobRequest, JobStatus
from deeppool.coordinator.store import Store

REPO = Path(__file__).resolve().parents[2]
MODEL = str(REPO / "examples" / "background_mlp.py")


def scraped(http: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = http.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def test_metrics_count_jobs_queue_and_gpus(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    store.create_token("alice")
    http = TestClient(create_app(store, ServerSettings(gpus=4, allowed_roots=(REPO / "examples",),
                                                       log_dir=tmp_path)))
    empty = scraped(http)
    assert empty[("deeppool_queue_length", ())] == 0 and empty[("deeppool_gpus", ())] == 4
    assert empty[("deeppool_jobs", (("kind", "fg"), ("state", "RUNNING")))] == 0
    host, _ = store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model=MODEL, gpus=2, batch=8))
    lodger, _ = store.submit("alice", JobRequest(kind=JobKind.BACKGROUND, model=MODEL, batch=8))
    alone, _ = store.submit("alice", JobRequest(kind=JobKind.BACKGROUND, model=MODEL, batch=8))
    store.submit("alice", JobRequest(kind=JobKind.BACKGROUND, model=MODEL, batch=8))
    for job, where in ((host, None), (lodger, host.id), (alone, None)):
        assert store.transition(job.id, JobStatus.STARTING, "test", host_id=where)
        assert store.transition(job.id, JobStatus.RUNNING, "test")
    metrics = scraped(http)
    assert metrics[("deeppool_jobs", (("kind", "fg"), ("state", "RUNNING")))] == 1
    assert metrics[("deeppool_jobs", (("kind", "bg"), ("state", "RUNNING")))] == 2
    assert metrics[("deeppool_jobs", (("kind", "bg"), ("state", "PENDING")))] == 1
    assert metrics[("deeppool_queue_length", ())] == 1
    assert metrics[("deeppool_gpus_busy", ())] == 3  # the host's 2 and the lone background job's free GPU
    assert metrics[("deeppool_gpus_lent", ())] == 2  # the host's GPUs lend their idle windows
