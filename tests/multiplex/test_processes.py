"""Real processes: the background child, `deeppool run --background`, failures on either side, leftovers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from deeppool.multiplex.config import BackgroundConfig, MuxMode
from deeppool.multiplex.cpu import ProcessBackground, child_spec
from deeppool.plans import Plan
from tests.entry import deeppool
from tests.executor.plans import cycle, make_plan
from tests.multiplex.plans import BACKGROUND, MODELS, burst_plan

pytestmark = pytest.mark.slow

GATE_SLOWDOWN_LIMIT = 0.5
GATE_SPEEDUP_LIMIT = -0.75
GATE_RECOVERED_FLOOR = 0.0
"""``--mux gate`` on the burst plan, 60 steps, 2 ranks on this 2-core machine, quiet (six runs): foreground
slowdown -0.06 to 0.31 (medians of 21 steps each side, noise dominates), recovered 0.19 to 0.37 of the
idle rank-time, 4 to 15 background steps; with one more busy process on the two cores, recovered 0.012 to
0.10 (so the floor only tells a gate that admits work from one that never does). With 20 steps (6 a side) a quiet machine's few short windows admitted 0 to 3 background steps, and
recovered fell to 0 in some runs: too few windows to test the gate on. A gate that let the child run outside windows (slowdown) or never in them (recovered) falls outside
these limits; they are not the ≤ 5% / ≥ 50% goal, which is for a GPU (``benchmarks/gpu.py``).
The child sized its first piece from a cold pass until it warmed up before its first window: with one busy
process beside it, one run of three trained 0 steps (a fresh-clone CI failed on this); warmed, 3 of 3 such
runs trained 4 to 24 steps (recovered 0.07 to 0.28), and 3 quiet runs 5 to 24 (0.19 to 0.46)."""


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (read from /proc, no psutil)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    burst_plan().save(path)
    return path


def state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def stopped(pid: int, timeout_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while state(pid) not in "Tt":
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_gated_child_trains_only_inside_windows_and_leaves_nothing(tmp_path: Path) -> None:
    config = BackgroundConfig(model=BACKGROUND, mode=MuxMode.GATE, checkpoint_dir=tmp_path)
    child = ProcessBackground(child_spec(config, rank=1, stats=tmp_path / "stats.json"), rank=1, folder=tmp_path)
    child.wait_ready(60)
    assert child.ready
    for _ in range(40):
        child.admit(time.perf_counter() + 1.0, 10.0)  # a generous deadline: the close is what ends the window
        time.sleep(0.01)
        child.close(10.0)
        assert stopped(child.pid)  # between windows (a runnable child stops the next time it is scheduled)
    ticks = cpu_ticks(child.pid)
    time.sleep(0.3)
    assert cpu_ticks(child.pid) == ticks  # no background work outside a window
    result = child.stop()
    assert result.exit_code == 0 and result.error is None
    assert result.steps > 3 and result.busy_s > 0 and result.tokens == 40
    assert len(result.windows) == 40 and sum(busy for _, busy in result.windows) <= 40 * 10.0 * 1.2
    assert (tmp_path / "background-rank1.pt").exists()
    assert not alive(result.pid)


def test_run_with_a_gated_background(plan_path: Path, tmp_path: Path, capfd, monkeypatch) -> None:
    """It trains in the windows, and the launching process reads the plan file once (each rank once itself)."""
    out, loads, load = tmp_path / "out", [], Plan.load
    monkeypatch.setattr(Plan, "load", lambda path: loads.append(Path(path)) or load(path))
    proc = deeppool(capfd, "run", str(plan_path), "--nproc", "2", "--background", str(BACKGROUND), "--bg-batch", "8",
                    "--mux", "gate", "--steps", "150", "--out", str(out))  # at 60 steps of ~5 ms it read -0.14 to 0.52
    assert proc.code == 0, proc.stderr[-3000:]
    assert loads == [plan_path]
    mux = json.loads((out / "summary.json").read_text())["multiplex"]
    assert mux["fg_slowdown"] == pytest.approx(mux["fg_shared_ms"] / mux["fg_alone_ms"] - 1)
    assert GATE_SPEEDUP_LIMIT < mux["fg_slowdown"] < GATE_SLOWDOWN_LIMIT, mux
    assert GATE_RECOVERED_FLOOR < mux["recovered_fraction"] <= 1.0, mux
    assert mux["bg_samples_per_s"] > 0 and mux["net_gain"] > 0 and mux["fg_iteration_ms"] == mux["fg_shared_ms"]
    assert mux["bg_busy_s"] > 0 and mux["bg_errors"] == [] and mux["mode"] == "gate"
    assert "fg slowdown" in proc.stdout and "recovered" in proc.stdout
    events = json.loads((out / "trace-rank1.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "background" for e in events)
    assert (out / "background" / "background-rank1.pt").exists()
    assert not any(alive(pid) for pid in mux["bg_pids"])


def test_a_crashing_background_is_reported_and_the_foreground_finishes(plan_path: Path, tmp_path: Path,
                                                                      capfd) -> None:
    out = tmp_path / "out"
    proc = deeppool(capfd, "run", str(plan_path), "--nproc", "2", "--background", str(MODELS / "crashing_bg.py"),
                    "--mux", "none", "--steps", "16", "--out", str(out))
    assert proc.code == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["losses"]) == 16
    assert summary["multiplex"]["bg_errors"] == ["rank 1: background RuntimeError: background model blew up"]
    assert "background model blew up; the foreground went on" in proc.stdout


@pytest.mark.parametrize("fault", ["raise:1:20", pytest.param("kill:1:20", marks=pytest.mark.heavy)])
def test_a_foreground_failure_stops_the_background(tmp_path: Path, fault: str, capfd, monkeypatch) -> None:
    plan = tmp_path / "plan.json"
    make_plan("faulty", global_batch=6, gpus=2, assign=cycle(2, 1)).save(plan)
    out = tmp_path / "out"
    monkeypatch.setenv("DEEPPOOL_TEST_FAULT", fault)  # read by the ranks
    proc = deeppool(capfd, "run", str(plan), "--nproc", "2", "--background", str(BACKGROUND), "--mux", "none",
                    "--steps", "200", "--timeout", "5", "--out", str(out))
    assert proc.code == 1, proc.stderr[-2000:]
    pid = int((out / "background" / "background-rank1.pid").read_text())
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--background", str(MODELS / "broken_bg.py")), "failed to import"),
        (("--background", str(BACKGROUND), "--mux", "priority"), "--mux priority needs a CUDA GPU"),
        (("--background", str(BACKGROUND), "--mux", "mps"), "--mux mps needs a CUDA GPU"),
        (("--background", str(MODELS / "huge_bg.py")), "GiB"),
    ],
    ids=["unloadable", "priority", "mps", "too-big"],
)
def test_bad_background_input_is_one_line_and_exit_2(plan_path: Path, tmp_path: Path, args, message: str,
                                                     capfd) -> None:
    proc = deeppool(capfd, "run", str(plan_path), "--nproc", "2", *args, "--out", str(tmp_path))
    assert proc.code == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr


def test_a_plan_without_idle_windows_is_refused(tmp_path: Path, capfd) -> None:
    plan = tmp_path / "plan.json"
    burst_plan(lone=()).save(plan)
    proc = deeppool(capfd, "run", str(plan), "--nproc", "2", "--background", str(BACKGROUND), "--out", str(tmp_path))
    assert proc.code == 2
    assert proc.stderr.startswith("error: the plan has no idle windows") and "nothing to lend" in proc.stderr
