"""schemathesis against the OpenAPI document: no server errors, every response as documented."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from deeppool.coordinator.app import ServerSettings, create_app
from deeppool.coordinator.jobs import JobKind, JobRequest
from deeppool.coordinator.store import Store

REPO = Path(__file__).resolve().parents[2]
FOLDER = Path(tempfile.mkdtemp(prefix="deeppool-fuzz-"))
STORE = Store(FOLDER / "db.sqlite")
TOKEN = STORE.create_token("alice")
STORE.create_token("bob")
STORE.submit("bob", JobRequest(kind=JobKind.FOREGROUND, model="examples.mlp:model", gpus=1, batch=8))  # job 1: not ours
STORE.submit("alice", JobRequest(kind=JobKind.BACKGROUND, model="examples.mlp:model", batch=8))  # job 2: ours
(FOLDER / "logs").mkdir()
APP = create_app(STORE, ServerSettings(gpus=4, allowed_roots=(REPO / "examples",), log_dir=FOLDER / "logs"))
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)

pytestmark = pytest.mark.slow


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors_and_documented_responses(case) -> None:
    response = case.call(headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code < 500, response.text
    # a schema-valid request may still be refused: a model file that does not exist, more GPUs than the cluster's
    case.validate_response(response, excluded_checks=[positive_data_acceptance])
    if response.status_code >= 400:
        assert response.json()["detail"]  # every refusal says why
