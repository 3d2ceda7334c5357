"""Real processes: `deeppool run` over gloo, --check, traces, faults and Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deeppool.executor.training.outputs import PROGRESS
from deeppool.executor.training.reference import CheckResult
from tests.entry import Result, deeppool
from tests.executor.plans import Assign, cycle, make_plan, model_path

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def deeppool_run(capture: pytest.CaptureFixture[str], plan_path: Path, *args: str) -> tuple[Result, float]:
    """``deeppool run PLAN ARGS`` through the entry point in this process (the ranks are processes anyway)."""
    started = time.monotonic()
    result = deeppool(capture, "run", str(plan_path), *args)
    return result, time.monotonic() - started


CHECKS = [
    ("mlp", 6, 2, cycle(2, 1)),
    ("residual", 7, 4, cycle(1, 4, 2, 3)),
    ("branching", 6, 4, cycle(2, 4, 3, 1)),
    ("tiny_gpt", 5, 2, cycle(2, 1, 2)),
]


HEAVY_CHECKS = {"residual-4ranks"}
"""In the heavy tier (7 s): branching-4ranks runs 4 ranks with reshards both ways in the default run."""


def _check_param(check: tuple) -> object:
    name = f"{check[0]}-{check[2]}ranks"
    return pytest.param(*check, id=name, marks=[pytest.mark.heavy] if name in HEAVY_CHECKS else [])


@pytest.mark.parametrize(("name", "batch", "gpus", "assign"), [_check_param(check) for check in CHECKS])
def test_check_matches_single_process(tmp_path: Path, capfd, name: str, batch: int, gpus: int,
                                      assign: Assign) -> None:
    plan_path = tmp_path / "plan.json"
    make_plan(name, global_batch=batch, gpus=gpus, assign=assign).save(plan_path)
    out = tmp_path / "out"
    proc, _ = deeppool_run(capfd, plan_path, "--nproc", str(gpus), "--steps", "3", "--check", "--lr", "0.1",
                           "--out", str(out))
    assert proc.code == 0, proc.stderr[-3000:]
    found = re.search(r"^max relative difference: (\S+) \(", proc.stdout, re.MULTILINE)
    assert found is not None, proc.stdout
    assert float(found.group(1)) <= 1e-4  # a tenth of the default bound
    summary = json.loads((out / "summary.json").read_text())
    assert summary["check"]["passed"] and len(summary["losses"]) == 3
    check = CheckResult.from_json(summary["check"])
    assert check.worst is not None and float(found.group(1)) == pytest.approx(check.max_relative_difference, rel=1e-3)
    for rank in range(gpus):
        events = json.loads((out / f"trace-rank{rank}.json").read_text())["traceEvents"]
        assert {e.get("cat") for e in events if e["ph"] == "X"} >= {"compute", "comm", "iteration"}


@pytest.fixture(scope="module")
def faulty_plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("faulty") / "plan.json"
    make_plan("faulty", global_batch=6, gpus=3, assign=cycle(3, 2, 3, 1)).save(path)
    return path


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        pytest.param("raise:1:6", "rank 1 failed: RuntimeError: injected failure", marks=pytest.mark.heavy),
        ("kill:2:6", "rank 2 was killed by SIGKILL"),
        ("hang:1:6", "rank 1 stopped responding"),
        pytest.param("stop:2:6", "rank 2 stopped responding", marks=pytest.mark.heavy),  # as hang's, 12 s
    ],
)
def test_a_failing_rank_stops_every_rank_and_is_named(faulty_plan: Path, tmp_path: Path, capfd, monkeypatch,
                                                      fault: str, message: str) -> None:
    monkeypatch.setenv("DEEPPOOL_TEST_FAULT", fault)  # read by the ranks
    proc, elapsed = deeppool_run(capfd, faulty_plan, "--steps", "50", "--timeout", "5", "--out", str(tmp_path))
    finished = time.time()
    assert proc.code == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, proc.stderr[-2000:]
    assert elapsed < 60
    first_record = min(json.loads(path.read_text())["time"] for path in tmp_path.glob("error-rank*.json"))
    assert finished - first_record < 10  # named within seconds of the first rank's failure (at --timeout for a hang)


def test_nproc_other_than_the_plan_is_refused_in_one_line(faulty_plan: Path, capsys) -> None:
    proc, _ = deeppool_run(capsys, faulty_plan, "--nproc", "2")
    assert proc.code == 2
    assert proc.stderr.strip() == "error: --nproc 2 differs from the plan's 3 GPUs: use --nproc 3 or re-plan for this many"


def test_ctrl_c_stops_all_ranks(faulty_plan: Path, tmp_path: Path) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-m", "deeppool.run_command", "run", str(faulty_plan), "--steps", "100000", "--out", str(tmp_path)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while not (tmp_path / PROGRESS).is_file() and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)  # rank 0 writes its progress after its first step: every rank is training
    assert launcher.poll() is None and (tmp_path / PROGRESS).is_file(), "the ranks never started training"
    os.killpg(launcher.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    _, stderr = launcher.communicate(timeout=60)
    assert launcher.returncode != 0
    leftover = subprocess.run(["pgrep", "-g", str(launcher.pid)], capture_output=True, text=True).stdout.split()
    assert leftover == [], stderr[-2000:]


def test_profile_network_then_plan_with_the_measured_network(tmp_path: Path, capfd) -> None:
    network = tmp_path / "net.json"
    probed = deeppool(capfd, "profile-network", "--nproc", "2", "--out", str(network), "--sizes", "4096,1048576",
                           "--repeats", "3", "--warmup", "1")
    assert probed.code == 0, probed.stderr[-2000:]
    assert "fitted: latency" in probed.stdout
    measured = json.loads(network.read_text())
    assert list(measured["skew"]) == ["2"] and measured["skew"]["2"] >= 0
    assert measured["skew_after_s"] == pytest.approx(0.01)
    plan_path = tmp_path / "plan.json"
    planned = deeppool(capfd, "plan", model_path("mlp"), "--gpus", "2", "--batch", "6", "--device-model", "a100",
                            "--network-file", str(network), "--out", str(plan_path))
    assert planned.code == 0, planned.stderr[-2000:]
    plan = json.loads(plan_path.read_text())
    assert plan["network"]["intra_bandwidth"] == pytest.approx(measured["intra_bandwidth"])
    assert plan["network"]["intra_latency_s"] == pytest.approx(measured["intra_latency_s"])
