"""`deeppool run --tensorboard DIR`: loss, throughput and the noise scale per step, as TensorBoard reads them,
written while the run goes on."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.executor.plans import cycle, make_plan

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_run_writes_its_figures_for_tensorboard(tmp_path: Path) -> None:
    make_plan("mlp", global_batch=8, gpus=2, assign=cycle(2, 1)).save(tmp_path / "plan.json")
    done = subprocess.run([sys.executable, "-m", "deeppool.cli", "run", "plan.json", "--steps", "4", "--monitor", "gns",
                           "--out", "run", "--tensorboard", "tb"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/iteration_ms", "train/samples_per_s", "gns/grad_sq", "gns/trace"} <= tags
    losses = [event.value for event in events.Scalars("train/loss")]
    assert len(losses) == 4 and losses[-1] < losses[0]
    throughput = events.Scalars("train/samples_per_s")
    assert [event.step for event in throughput] == [0, 1, 2, 3] and all(event.value > 0 for event in throughput)


def _scalars(folder: Path, tag: str) -> list:
    events = EventAccumulator(str(folder))
    events.Reload()
    return events.Scalars(tag) if tag in events.Tags()["scalars"] else []


@pytest.mark.slow
@pytest.mark.heavy
def test_the_scalars_appear_while_the_run_goes_on(tmp_path: Path) -> None:
    make_plan("mlp", global_batch=8, gpus=2, assign=cycle(2, 1)).save(tmp_path / "plan.json")
    run = subprocess.Popen([sys.executable, "-m", "deeppool.cli", "run", "plan.json", "--steps", "100000",
                            "--monitor-every", "2", "--out", "run", "--tensorboard", "tb"], cwd=tmp_path,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        seen: list = []
        deadline = time.monotonic() + 120
        while len(seen) < 4 and time.monotonic() < deadline and run.poll() is None:
            time.sleep(1.0)
            seen = _scalars(tmp_path / "tb", "train/loss") if (tmp_path / "tb").is_dir() else []
        assert run.poll() is None, run.stderr.read()[-2000:] if run.stderr else ""
        assert len(seen) >= 4, "no live scalars within 120 s"
        assert [event.step for event in seen] == list(range(len(seen)))
        assert all(event.value > 0 for event in seen)
    finally:
        run.kill()
        run.wait()


def test_tensorboard_into_a_file_is_one_line(tmp_path: Path) -> None:
    make_plan("mlp", global_batch=8, gpus=2, assign=cycle(2, 1)).save(tmp_path / "plan.json")
    (tmp_path / "tb").write_text("")
    done = subprocess.run([sys.executable, "-m", "deeppool.cli", "run", "plan.json", "--tensorboard", "tb"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().startswith("error: --tensorboard 'tb' is a file")
    assert "Traceback" not in done.stderr
