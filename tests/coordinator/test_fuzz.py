"""schemathesis against the OpenAPI document: no server errors, every response as documented."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import negative_data_rejection, positive_data_acceptance

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
    unauthorised = "Authorization" not in (case.headers or {})
    response = case.call(headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code < 500, response.text
    # a schema-valid request may still be refused: a model file that does not exist, more GPUs than the cluster's;
    # a case made invalid by leaving out the Authorization header is made valid again by the token given here
    # (CI once saw it accepted: 200), so whether invalid data is refused is checked only where it was kept
    excluded = [positive_data_acceptance, *([negative_data_rejection] if unauthorised else [])]
    case.validate_response(response, excluded_checks=excluded)
    if response.status_code >= 400:
        assert response.json()["detail"]  # every refusal says why


MODELS = FOLDER / "models"
MODELS.mkdir()
(MODELS / "loop.py").symlink_to(MODELS / "loop.py")
ATTACKS = [  # each gave a 500 before issue 21; what the refusal says
    ({"kind": "bg", "model": str(MODELS / "loop.py"), "batch": 8}, "link loop"),
    ({"kind": "bg", "model": str(MODELS / "a\x00.py"), "batch": 8}, "NUL"),
    ({"kind": "bg", "model": str(MODELS / ("x" * 300 + ".py")), "batch": 8}, "too long"),
    ({"kind": "bg", "model": str(MODELS / "\ud800.py"), "batch": 8}, "unicode"),
    *(({"kind": "bg", "model": "a.b:c", "input_shape": [4], "batch": 8, "amplification": value}, "finite")
      for value in (float("nan"), float("-inf"), float("inf"))),
]
FUZZED = create_app(STORE, ServerSettings(gpus=4, allowed_roots=(MODELS,), log_dir=FOLDER / "logs"))
ATTACKED = schemathesis.openapi.from_asgi("/openapi.json", FUZZED)


@pytest.mark.parametrize("body, says", ATTACKS,
                         ids=["link-loop", "nul", "long-name", "surrogate", "nan", "-inf", "inf"])
def test_the_issue_21_attacks_are_refused_as_documented(body: dict, says: str) -> None:
    case = ATTACKED["/v1/jobs"]["POST"].Case(body=body, media_type="application/json")
    # as written (NaN and Infinity are not JSON, but Python's and JavaScript's encoders write them)
    response = case.call(headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
                         data=json.dumps(body).encode(), json=None)
    assert 400 <= response.status_code < 500, response.text
    case.validate_response(response, excluded_checks=[positive_data_acceptance])
    assert says in response.text


def test_a_far_log_offset_is_refused_as_documented() -> None:
    case = ATTACKED["/v1/jobs/{job_id}/logs"]["GET"].Case(path_parameters={"job_id": 2},
                                                          query={"offset": 17592186044415})
    response = case.call(headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status_code == 416 and response.json()["detail"]
    case.validate_response(response, excluded_checks=[positive_data_acceptance])
