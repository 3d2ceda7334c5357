"""Script jobs: a foreground job that brings its own training loop (``script``), run on every rank with the
plan the coordinator made, as ``deeppool run --script`` runs it."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from deeppool.coordinator.app import ServerSettings, create_app
from deeppool.coordinator.driver import DriverSpec, drive
from deeppool.coordinator.store import SCHEMA, Store

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "examples" / "background_mlp.py"
SCRIPT = '''
import importlib.util
import os
import sys

import torch

import deeppool

plan = deeppool.Plan.load(os.environ["DEEPPOOL_PLAN"])
spec = importlib.util.spec_from_file_location("model", plan.model.location)
model = importlib.util.module_from_spec(spec)
spec.loader.exec_module(model)
bp = deeppool.parallelize(model.model(), plan)
opt = torch.optim.SGD(bp.parameters(), lr=0.01)
for _ in range(2):
    loss = bp.step(model.inputs(plan.global_batch), model.targets(plan.global_batch), model.loss)
    opt.step()
    opt.zero_grad()
if bp.is_logging_rank:
    with open(os.path.join(os.path.dirname(os.path.abspath(sys.argv[0])), "done.txt"), "w") as done:
        done.write(f"{loss.item():.6f}")
'''


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_a_script_job_is_checked_and_kept(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite")
    token = store.create_token("alice")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    http = TestClient(create_app(store, ServerSettings(gpus=4, allowed_roots=(REPO / "examples", tmp_path),
                                                       log_dir=tmp_path)))
    body = {"kind": "fg", "model": str(MODEL), "gpus": 2, "batch": 8}
    made = http.post("/v1/jobs", json={**body, "script": str(script)}, headers=auth(token))
    assert made.status_code == 201 and made.json()["script"] == str(script)
    assert http.get(f"/v1/jobs/{made.json()['id']}", headers=auth(token)).json()["script"] == str(script)
    refused = {
        "bg": ({**body, "kind": "bg", "script": str(script)}, 422),
        "outside": ({**body, "script": "/etc/train.py"}, 403),
        "not python": ({**body, "script": str(tmp_path / "train.sh")}, 422),
        "missing": ({**body, "script": str(tmp_path / "gone.py")}, 422),
    }
    for name, (request, code) in refused.items():
        assert http.post("/v1/jobs", json=request, headers=auth(token)).status_code == code, name


def test_a_database_from_before_script_jobs_opens(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as db:
        db.executescript(SCHEMA.replace("    script TEXT,\n", ""))
    store = Store(path)
    store.create_token("alice")
    assert store.jobs() == []


@pytest.mark.slow
def test_the_driver_runs_a_script_job_on_its_plan(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text(SCRIPT)
    summary = drive(DriverSpec(model=str(MODEL), gpus=2, batch=8, steps=2, amplification=None, out=tmp_path / "job",
                               script=str(tmp_path / "train.py")))
    assert summary == {"script": str(tmp_path / "train.py"), "gpus": 2}
    assert float((tmp_path / "job" / "script" / "done.txt").read_text()) > 0  # the staged copy ran (checked at launch)
    assert not (tmp_path / "done.txt").exists()
