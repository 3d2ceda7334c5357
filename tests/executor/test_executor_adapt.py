"""Real processes: stragglers found (an injected slow rank) or not (a healthy run); policies' actions on every rank."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from deeppool.cli import main
from deeppool.executor.training.checkpoint import latest, load_run
from deeppool.executor.training.outputs import EVENTS, RESIZE
from deeppool.plans import Plan
from tests.entry import deeppool
from tests.executor.plans import Assign, cycle, make_plan
from tests.executor.test_executor_processes import deeppool_run

pytestmark = pytest.mark.slow
POLICIES = Path(__file__).resolve().parents[1] / "adaptation" / "policies.py"


def run(capfd: pytest.CaptureFixture[str], plan_path: Path, out: Path, *args: str) -> tuple[dict, str]:
    proc, _ = deeppool_run(capfd, plan_path, "--out", str(out), *args)
    assert proc.code == 0, proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text()), proc.stdout


def saved(tmp_path: Path, name: str, batch: int, gpus: int, assign: Assign) -> Path:
    path = tmp_path / "plan.json"
    make_plan(name, global_batch=batch, gpus=gpus, assign=assign).save(path)
    return path


MOMENTUM = ("--steps", "5", "--lr", "0.1", "--momentum", "0.9")


@pytest.fixture(scope="module")
def momentum_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The summary of one plain run (mlp on 2 ranks, :data:`MOMENTUM`, no policy) that policies' runs are held to."""
    folder = tmp_path_factory.mktemp("momentum")
    try:
        main(["run", str(saved(folder, "mlp", 8, 2, cycle(2, 1))), "--out", str(folder / "out"), *MOMENTUM])
    except SystemExit as done:
        assert done.code in (0, None), done.code
    return json.loads((folder / "out" / "summary.json").read_text())


SLOW = [pytest.param("mlp", 2, cycle(2), 1, marks=pytest.mark.heavy),
        pytest.param("mlp", 4, cycle(4), 3, marks=pytest.mark.heavy)]
"""In the heavy tier (11 s on 2 ranks, 8 s on 4): the default run flags a slow rank through
``test_in_a_burst_plan_the_slow_rank_of_a_group_is_found_first`` (a burst plan's groups)."""


STEPS_PAST_THE_FLOOR = {2: "2500", 4: "600"}
"""Runs of about 5 s on this machine (mlp: 2.2 ms a step on 2 ranks with one at half speed, 6-9 ms on 4), past
the executor's 2 s a rank must stay slow (``steptimes.MIN_SLOW_MS``)."""


@pytest.mark.parametrize(("name", "gpus", "assign", "slow"), SLOW, ids=["data-parallel-2", "data-parallel-4"])
def test_an_injected_slow_rank_is_flagged(tmp_path: Path, capfd, monkeypatch, name: str, gpus: int,
                                          assign: Assign, slow: int) -> None:
    monkeypatch.setenv("DEEPPOOL_FAULT", f"slow-rank:{slow}")
    steps = STEPS_PAST_THE_FLOOR[gpus]
    summary, stdout = run(capfd, saved(tmp_path, name, 8, gpus, assign), tmp_path / "out", "--steps", steps)
    assert [s["rank"] for s in summary["stragglers"]] == [slow]
    assert summary["stragglers"][0]["relative_speed"] < 0.8
    events = [json.loads(line) for line in (tmp_path / "out" / EVENTS).read_text().splitlines()]
    assert [(e["kind"], e["rank"]) for e in events] == [("straggler", slow)]
    assert f"straggler: rank {slow} is a straggler since step" in stdout


def test_in_a_burst_plan_the_slow_rank_of_a_group_is_found_first(tmp_path: Path, capfd, monkeypatch) -> None:
    """Ranks 0..3 share the 4-GPU stages, 0..2 the 3-GPU ones, 0..1 the 2-GPU ones; rank 2 is slowed."""
    monkeypatch.setenv("DEEPPOOL_FAULT", "slow-rank:2")
    summary, _ = run(capfd, saved(tmp_path, "residual", 8, 4, cycle(1, 4, 2, 3)), tmp_path / "out", "--steps", "100")
    assert summary["stragglers"][0]["rank"] == 2 and summary["stragglers"][0]["relative_speed"] < 0.8


@pytest.mark.heavy
def test_healthy_ranks_are_never_flagged(tmp_path: Path, capfd) -> None:
    """4 ranks on the CI host's 2 cores, about 5 s: a core there computes 1.4-1.5x slower for stretches of up to
    0.7 s (300 steps of 1-2 ms flagged a healthy rank at 0.76x before the time floor)."""
    plan_path = saved(tmp_path, "mlp", 8, 4, cycle(4))
    summary, _ = run(capfd, plan_path, tmp_path / "out", "--steps", STEPS_PAST_THE_FLOOR[4])
    assert summary["stragglers"] == []
    assert not (tmp_path / "out" / EVENTS).exists()


def test_a_policy_sets_the_learning_rate_on_every_rank(tmp_path: Path, capfd, momentum_run: dict) -> None:
    plan_path = saved(tmp_path, "mlp", 8, 2, cycle(2, 1))
    ckpt = tmp_path / "ckpt"
    halved, stdout = run(capfd, plan_path, tmp_path / "halved", "--steps", "3", "--lr", "0.2", "--momentum", "0.9",
                         "--policy", f"{POLICIES}:halve_lr", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3")
    # every rank stepped with 0.1 from the first step, bit for bit (a constant schedule: 3 steps are 5's first 3)
    assert halved["losses"] == momentum_run["losses"][:3]
    assert halved["policy"]["lr"] == 0.1 and halved["policy"]["actions"] == [{"kind": "lr", "step": 0, "lr": 0.1}]
    assert "policy: learning rate 0.1 from step 0" in stdout
    run_state = load_run(ckpt, 3)  # what every rank has alike: the optimizer's groups, the schedule, the progress
    assert [group["lr"] for group in run_state.optimizer_groups] == [0.1]
    assert run_state.scheduler["base_lrs"] == [0.1] and run_state.progress["lr"] == 0.1


def test_accumulation_changed_mid_run_keeps_the_mean_gradient(tmp_path: Path, capfd, momentum_run: dict) -> None:
    plan_path = saved(tmp_path, "mlp", 8, 2, cycle(2, 1))
    grown, _ = run(capfd, plan_path, tmp_path / "grown", *MOMENTUM, "--policy", f"{POLICIES}:accumulate_two")
    # the synthetic batch is the same every time: the mean over two copies is the gradient of one, exactly
    # (and so is the momentum that gradient feeds)
    assert grown["losses"] == momentum_run["losses"]
    assert grown["policy"]["accumulate"] == 2
    assert grown["policy"]["actions"] == [{"kind": "accumulate", "step": 2, "accumulate": 2, "batch": 16}]


def test_a_gpu_request_ends_with_a_checkpoint_and_a_plan_that_resume_continues(tmp_path: Path, capfd,
                                                                               momentum_run: dict) -> None:
    plan_path, whole = saved(tmp_path, "mlp", 8, 2, cycle(2, 1)), momentum_run
    first, stdout = run(capfd, plan_path, tmp_path / "first", *MOMENTUM, "--policy", f"{POLICIES}:one_gpu",
                        "--checkpoint-dir", str(tmp_path / "ckpt"))
    assert json.loads((tmp_path / "first" / RESIZE).read_text())["gpus"] == 1
    assert latest(tmp_path / "ckpt") == 2 and first["policy"]["requested_gpus"] == 1
    assert first["losses"] == whole["losses"][:2]
    new_plan = tmp_path / "ckpt" / "plan-1gpus.json"
    assert Plan.load(new_plan).gpus == 1
    lines = stdout.splitlines()
    command = shlex.split(lines[[i for i, line in enumerate(lines) if line.endswith("resume with:")][0] + 1])
    assert command[:3] == ["deeppool", "run", str(new_plan)] and "--resume" in command
    command[command.index("--out") + 1] = str(tmp_path / "second")
    resumed = deeppool(capfd, *command[1:])
    assert resumed.code == 0, resumed.stderr[-3000:]
    second = json.loads((tmp_path / "second" / "summary.json").read_text())
    assert second["gpus"] == 1 and len(second["losses"]) == 3
    assert second["losses"] == pytest.approx(whole["losses"][2:], rel=1e-5)


def test_grow_batch_doubles_accumulation_while_the_measured_noise_scale_is_large(tmp_path: Path, capfd) -> None:
    """The noisy quadratic (``g_i = w + x_i``, σ = 1 in 768 dimensions): as ``w`` nears the batch's optimum,
    ``B_noise = tr(Σ)/|G|²`` grows past 4 × the batch (then ∞ once the smoothed ``|G|²`` is not positive), and
    grow-batch doubles K at its 10-step checks."""
    plan_path = saved(tmp_path, "noisy_quadratic", 8, 2, cycle(2))
    summary, stdout = run(capfd, plan_path, tmp_path / "out", "--steps", "21", "--lr", "0.1", "--monitor", "gns",
                          "--policy", "grow-batch")
    actions = summary["policy"]["actions"]
    assert [a["step"] for a in actions] == [10, 20] and [a["accumulate"] for a in actions] == [2, 4]
    assert summary["policy"]["accumulate"] == 4
    assert "policy: accumulate 2 micro-batches (batch 16) from step 10" in stdout
    trace = json.loads((tmp_path / "out" / "trace-rank0.json").read_text())["traceEvents"]
    gns = [e["args"].get("noise_scale") for e in trace if e.get("ph") == "C" and e.get("name") == "gns"]
    assert gns[0] < 4 * 8 <= gns[4]  # the measured noise scale grows past 4 B ...
    assert all(g is None or g >= 4 * 16 for g in (gns[9], gns[19]))  # ... and stays there (None: ∞ in JSON)
