"""The REST API in-process: authentication, ownership, idempotency, validation, confinement, cancel, cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from deeppool.coordinator.app import ServerSettings, create_app
from deeppool.coordinator.client import Client
from deeppool.coordinator.jobs import JobKind, JobRequest, JobStatus
from deeppool.coordinator.store import Store
from deeppool.errors import DeeppoolError

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "examples" / "background_mlp.py"


@pytest.fixture
def server(tmp_path: Path):
    store = Store(tmp_path / "db.sqlite")
    tokens = {name: store.create_token(name) for name in ("alice", "bob")}
    settings = ServerSettings(gpus=4, allowed_roots=(REPO / "examples",), log_dir=tmp_path / "logs")
    settings.log_dir.mkdir()
    http = TestClient(create_app(store, settings))
    return http, tokens, store, settings


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def body(**extra) -> dict:
    return {"kind": "fg", "model": str(MODEL), "gpus": 2, "batch": 32, "steps": 10, **extra}


def test_health_needs_no_token_and_everything_else_does(server) -> None:
    http, tokens, _, _ = server
    assert http.get("/healthz").json() == {"ok": True}
    for method, path in (("GET", "/v1/jobs"), ("POST", "/v1/jobs"), ("GET", "/v1/jobs/1"), ("GET", "/v1/cluster"),
                         ("POST", "/v1/jobs/1/cancel"), ("GET", "/v1/jobs/1/logs")):
        assert http.request(method, path).status_code == 401
        assert http.request(method, path, headers=auth("not-a-token")).status_code == 401
    schemes = http.get("/openapi.json").json()["components"]["securitySchemes"]
    assert schemes == {"HTTPBearer": {"type": "http", "scheme": "bearer",
                                      "description": "a token from `deeppool token create NAME`"}}


def test_submit_is_idempotent_and_owned(server) -> None:
    http, tokens, _, _ = server
    first = http.post("/v1/jobs", json=body(idempotency_key="run-1"), headers=auth(tokens["alice"]))
    assert first.status_code == 201
    job = first.json()
    assert job["kind"] == "fg" and job["state"] == "PENDING" and job["owner"] == "alice"
    again = http.post("/v1/jobs", json=body(idempotency_key="run-1"), headers=auth(tokens["alice"]))
    assert again.status_code == 200 and again.json()["id"] == job["id"]
    assert http.get(f"/v1/jobs/{job['id']}", headers=auth(tokens["bob"])).status_code == 403
    assert http.post(f"/v1/jobs/{job['id']}/cancel", headers=auth(tokens["bob"])).status_code == 403
    assert http.get("/v1/jobs", headers=auth(tokens["bob"])).json() == []
    assert http.get("/v1/jobs/999", headers=auth(tokens["alice"])).status_code == 404


@pytest.mark.parametrize("bad, code", [
    ({"kind": "xx"}, 422), ({"gpus": 0}, 422), ({"batch": -1}, 422), ({"shell": "rm -rf /"}, 422),
    ({"gpus": 64}, 422), ({"model": "/etc/passwd.py"}, 403), ({"model": str(REPO / "deeppool" / "cli.py")}, 403),
    ({"model": str(REPO / "examples" / "missing.py")}, 422), ({"model": "echo hi; rm -rf ~"}, 422),
    ({"model": str(REPO / "examples" / ".." / "deeppool" / "cli.py")}, 403),
])
def test_bad_submissions_are_4xx_with_a_message(server, bad: dict, code: int) -> None:
    http, tokens, store, _ = server
    response = http.post("/v1/jobs", json=body(**bad), headers=auth(tokens["alice"]))
    assert response.status_code == code and response.json()["detail"]
    assert store.jobs() == []


@pytest.mark.parametrize("relative", ["background_mlp.py", "./background_mlp.py", "../examples/background_mlp.py"])
def test_a_relative_model_path_is_refused_with_422_asking_for_an_absolute_one(server, monkeypatch, relative) -> None:
    http, tokens, store, _ = server
    monkeypatch.chdir(REPO / "examples")  # the file is there, under the allowed root, from the server's folder
    response = http.post("/v1/jobs", json=body(model=relative), headers=auth(tokens["alice"]))
    assert response.status_code == 422, response.text
    assert "relative path" in response.json()["detail"] and "absolute path" in response.json()["detail"]
    script = http.post("/v1/jobs", json=body(script=relative), headers=auth(tokens["alice"]))
    assert script.status_code == 422 and "absolute path" in script.json()["detail"]
    assert store.jobs() == []
    absolute = http.post("/v1/jobs", json=body(model=str(Path(relative).resolve())), headers=auth(tokens["alice"]))
    assert absolute.status_code == 201, absolute.text


def test_cancel_then_cancel_again(server) -> None:
    http, tokens, store, _ = server
    job = http.post("/v1/jobs", json=body(), headers=auth(tokens["alice"])).json()
    cancelled = http.post(f"/v1/jobs/{job['id']}/cancel", headers=auth(tokens["alice"]))
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "CANCELLED"
    assert http.post(f"/v1/jobs/{job['id']}/cancel", headers=auth(tokens["alice"])).status_code == 409
    assert [e.to_state for e in store.events(job["id"])] == [JobStatus.PENDING, JobStatus.CANCELLED]


def test_cluster_and_logs(server) -> None:
    http, tokens, store, settings = server
    job = http.post("/v1/jobs", json=body(gpus=3), headers=auth(tokens["alice"])).json()
    store.transition(job["id"], JobStatus.STARTING, "granted 3 GPUs")
    cluster = http.get("/v1/cluster", headers=auth(tokens["bob"])).json()
    assert cluster["gpus"] == 4 and cluster["allocated"] == 3 and cluster["allocations"][0]["job_id"] == job["id"]
    (settings.log_dir / f"job-{job['id']}.log").write_text("step 1\nstep 2\n")
    first = http.get(f"/v1/jobs/{job['id']}/logs", headers=auth(tokens["alice"]))
    assert first.text == "step 1\nstep 2\n" and first.headers["X-Next-Offset"] == "14"
    assert http.get(f"/v1/jobs/{job['id']}/logs?offset=7", headers=auth(tokens["alice"])).text == "step 2\n"


def test_the_python_client_over_the_api(server, monkeypatch: pytest.MonkeyPatch) -> None:
    http, tokens, _, _ = server
    client = Client("http://testserver", tokens["alice"], http=http)
    job = client.submit(JobRequest(kind=JobKind.BACKGROUND, model=str(MODEL), batch=8, gpus=3))
    assert job.gpus == 1  # background jobs are single-GPU
    assert [j.id for j in client.jobs()] == [job.id]
    assert client.cancel(job.id).state is JobStatus.CANCELLED
    with pytest.raises(DeeppoolError, match="HTTP 409"):
        client.cancel(job.id)
    monkeypatch.delenv("DEEPPOOL_TOKEN", raising=False)
    with pytest.raises(DeeppoolError, match="no token"):
        Client("http://testserver")
