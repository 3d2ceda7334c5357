"""A batch change end to end on real processes: the coordinator, with a noise scale measured, moves a running job
to another global batch; its learning rate follows AdaScale's gain and its steps left are converted (progress
in steps at the asked batch), as its checkpoints and steps show."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from deeppool.adaptation.goodput import adascale_gain
from deeppool.coordinator.driver import DriverSteps
from deeppool.coordinator.elastic import Elastic, converted_steps
from deeppool.coordinator.jobs import JobKind, JobRequest, JobStatus
from deeppool.coordinator.launcher import LocalLauncher
from deeppool.coordinator.runtime import Runtime
from deeppool.coordinator.service import Service
from deeppool.coordinator.store import Store
from deeppool.executor.config import OptimizerConfig
from deeppool.executor.training.checkpoint import latest, load_run
from deeppool.scheduling import POLICIES, Decision, Rebatch, Snapshot

pytestmark = [pytest.mark.slow, pytest.mark.heavy]  # real ranks, two stops and a restart: minutes on busy cores
REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "tests" / "coordinator" / "models" / "burst_cnn.py"
ASKED, CHANGED, STEPS = 64, 128, 200


@dataclass
class RebatchOnceNoise:
    """FIFO with backfilling; job ``job_id`` gets batch ``CHANGED`` once the coordinator has its noise scale,
    then, once measured at that batch, is stopped resumably (a checkpoint at the new batch and learning rate)."""

    job_id: int
    store: Store
    name: str = "rebatch-once-noise"

    def decide(self, snap: Snapshot) -> Decision:
        if self.job_id in snap.holding and not self.store.resizing(self.job_id):
            points = self.store.speeds([self.job_id])[self.job_id]
            state = snap.adaptive.get(self.job_id)
            batch = state.batch if state is not None else None
            if batch == ASKED and any(p.batch == ASKED and p.gns is not None for p in points):
                return Decision(rebatch=(Rebatch(job_id=self.job_id, batch=CHANGED),))
            if batch == CHANGED and any(p.batch == CHANGED for p in points):
                return Decision(preempt=(self.job_id,))
        return POLICIES["fifo-backfill"].decide(snap)


def test_a_batch_change_scales_the_lr_by_adascale_and_converts_the_steps_left(tmp_path: Path) -> None:
    store = Store(tmp_path / "deeppool.db")
    store.create_token("alice")
    # no amplification cap: the 2-GPU plan splits the convolutions' batch over both GPUs (their gradients are
    # all-reduced, which is where the noise scale is measured); under the cap of 1.5 every layer is on one GPU
    job, _ = store.submit("alice", JobRequest(kind=JobKind.FOREGROUND, model=str(MODEL), gpus=2, batch=ASKED,
                                              steps=STEPS))
    folder = tmp_path / "jobs"
    runtime = Runtime(store, LocalLauncher(folder, cgroups=False),
                      DriverSteps(folder=folder, elastic=True, measure_gns=True, allowed_roots=(REPO,)), grace_s=30)
    service = Service(runtime, RebatchOnceNoise(job_id=job.id, store=store), 2, elastic=Elastic(runtime, 2))
    deadline = time.monotonic() + 900
    while len([c for c in store.resizes(job.id) if c.phase == "DONE"]) < 2:
        service.tick()
        current = store.job(job.id)
        events = [e.reason for e in store.events(job.id)]
        assert not current.state.terminal and time.monotonic() < deadline, (current.state, events)
        time.sleep(0.3)
    change, stop = store.resizes(job.id)
    assert (change.from_gpus, change.to_gpus, change.from_batch, change.to_batch) == (2, 2, ASKED, CHANGED)
    assert (stop.to_gpus, stop.to_batch) == (0, CHANGED)
    noise = next(p.gns for p in store.speeds([job.id])[job.id] if p.batch == ASKED)
    gain = adascale_gain(CHANGED, base_batch=ASKED, noise_scale=noise)
    assert 1.0 < gain < CHANGED / ASKED
    current = store.job(job.id)
    assert current.run_batch == CHANGED and math.isclose(current.run_gain, gain)
    done = change.steps_done
    assert current.run_steps == converted_steps(STEPS, done, from_gain=1.0, to_gain=gain)
    # the run at the new batch resumed after step `done` and trained CHANGED samples a step
    lines = [json.loads(line) for line in (folder / f"job-{job.id}" / "run" / "steps.jsonl").read_text().splitlines()]
    assert min(line["step"] for line in lines) == done and {line["samples"] for line in lines} == {CHANGED}
    # its checkpoint at the stop: the learning rate is the base one times the gain
    checkpoints = folder / f"job-{job.id}" / "checkpoints"
    saved = latest(checkpoints)
    assert saved == stop.steps_done and saved > done
    groups = load_run(checkpoints, saved).optimizer_groups
    assert groups and all(math.isclose(group["lr"], OptimizerConfig().lr * gain) for group in groups), groups
    print(f"noise scale {noise:.1f}: batch {ASKED} -> {CHANGED}, gain {gain:.3f}, steps {STEPS} -> "
          f"{current.run_steps} after {done}")
    store.transition(job.id, JobStatus.CANCELLED, "the test has what it needs")
