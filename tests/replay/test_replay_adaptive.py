"""A pollux replay's simulated half: the coordinator's fitted speed models, widths over time, tick alignment."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from deeppool.cluster_sim.models import load_mapping
from deeppool.cluster_sim.shipped import resolve
from deeppool.cluster_sim.workload import read_workload
from deeppool.coordinator.jobs import JobSpeed, JobStatus, SpeedPoint, WidthChange
from deeppool.replay.adaptive import replay_adaptive
from deeppool.replay.live import LiveRecord, LiveRun, cut_by_width
from deeppool.replay.plot import live_bands
from deeppool.replay.slicing import SliceSettings, scale
from deeppool.scheduling.choice import ModelChoice

REPO = Path(__file__).resolve().parents[2]
MAPPING = REPO / "benchmarks" / "replay_models" / "mapping.json"


def _step_s(model: ModelChoice, gpus: int) -> float:
    return 0.1 / gpus


def test_held_intervals_are_cut_where_the_width_changed() -> None:
    held = ((1.0, 10.0), (20.0, 30.0))
    changes = [(1.0, 1), (4.0, 2), (25.0, 1)]
    assert cut_by_width(held, changes, 1) == ((1.0, 4.0, 1), (4.0, 10.0, 2), (20.0, 25.0, 2), (25.0, 30.0, 1))
    assert cut_by_width(((0.0, 5.0),), [], 3) == ((0.0, 5.0, 3),)


def test_a_pollux_replay_runs_each_job_by_the_coordinator_s_fit_and_draws_its_widths() -> None:
    """One job alone on 2 slots, measured by the coordinator at 1 slot (0.2 s a step) and 2 (0.1 s): a perfect
    linear fit (alpha 0). Submitted 10 s past a 60 s wall-clock tick, it waits 50 s for the next tick in the
    simulation too; Pollux gives a job at most twice the GPUs it has held (at least 1), so it runs on 1 slot:
    100 steps at 0.2 s, plus its start-up (held 20 s less 10 s of measured steps), before the next tick."""
    cut = scale(read_workload(resolve("workload-6")), SliceSettings(slots=2, jobs=2, span_s=1.0),
                load_mapping(MAPPING), _step_s)
    job = replace(cut.jobs[0], gpus=1, steps=100)
    points = [SpeedPoint(job_id=1, gpus=1, batch=job.batch, iteration_s=0.2, steps=10),
              SpeedPoint(job_id=1, gpus=2, batch=job.batch, iteration_s=0.1, steps=80)]
    speed = JobSpeed(job_id=1, points=points, resizes=[])
    record = LiveRecord(job=job, job_id=1, submitted_s=0.0, held=((50.0, 70.0),), state=JobStatus.SUCCEEDED,
                        reason="finished", iteration_s=0.1, widths=((50.0, 70.0, 2),), speed=speed)
    run = LiveRun(url="http://live", slots=2, records=(record,), began_at=60.0 * 1000 + 10.0)
    adaptive = replay_adaptive(run, "pollux")
    (fit,) = adaptive.fits
    assert fit.alpha_s == pytest.approx(0.0, abs=1e-9) and fit.beta_s * job.batch == pytest.approx(0.2)
    assert fit.start_up_s == pytest.approx(20.0 - 10 * 0.2 - 80 * 0.1)
    (band,) = adaptive.bands
    assert (band.gpus, band.start_s) == (1, pytest.approx(50.0))
    assert band.end_s == pytest.approx(50.0 + 100 * 0.2 + fit.start_up_s, abs=0.1)
    assert adaptive.comparison.live.makespan_s == 70.0
    assert adaptive.comparison.simulated.makespan_s == pytest.approx(band.end_s)
    assert [b.gpus for b in live_bands(run)] == [2]


def test_a_restart_is_charged_the_live_resizes_median_cost() -> None:
    cut = scale(read_workload(resolve("workload-6")), SliceSettings(slots=2, jobs=2, span_s=1.0),
                load_mapping(MAPPING), _step_s)
    job = replace(cut.jobs[0], gpus=1, steps=50)
    change = WidthChange(id=1, job_id=1, from_gpus=1, to_gpus=2, from_batch=job.batch, to_batch=job.batch,
                         from_steps=50, from_gain=1.0, phase="DONE", reason="pollux", asked_at=0.0, steps_done=5,
                         checkpoint_s=1.0, stop_s=2.0, plan_s=3.0, restart_s=4.0)
    speed = JobSpeed(job_id=1, points=[SpeedPoint(job_id=1, gpus=2, batch=job.batch, iteration_s=0.1, steps=40)],
                     resizes=[change])
    record = LiveRecord(job=job, job_id=1, submitted_s=0.0, held=((0.0, 30.0),), state=JobStatus.SUCCEEDED,
                        reason="finished", iteration_s=0.1, widths=((0.0, 10.0, 1), (10.0, 30.0, 2)), speed=speed)
    adaptive = replay_adaptive(LiveRun(url="http://live", slots=2, records=(record,), began_at=0.0), "pollux")
    assert adaptive.restart_s == pytest.approx(10.0)
    (fit,) = adaptive.fits
    assert fit.start_up_s == pytest.approx((30.0 - 40 * 0.1) / 2)


def test_the_simulation_ticks_at_the_coordinator_s_policy_interval() -> None:
    """The same job submitted 10 s past a wall-clock multiple of 20 s: under ``serve --policy-interval 20`` the
    simulated Pollux starts it at the next 20 s tick, 10 s after its submission (at 60 s it would wait 50 s)."""
    cut = scale(read_workload(resolve("workload-6")), SliceSettings(slots=2, jobs=2, span_s=1.0),
                load_mapping(MAPPING), _step_s)
    job = replace(cut.jobs[0], gpus=1, steps=100)
    speed = JobSpeed(job_id=1, points=[SpeedPoint(job_id=1, gpus=1, batch=job.batch, iteration_s=0.2, steps=90)],
                     resizes=[])
    record = LiveRecord(job=job, job_id=1, submitted_s=0.0, held=((10.0, 40.0),), state=JobStatus.SUCCEEDED,
                        reason="finished", iteration_s=0.2, widths=((10.0, 40.0, 1),), speed=speed)
    run = LiveRun(url="http://live", slots=2, records=(record,), began_at=20.0 * 3000 + 10.0)
    ticked = {interval: replay_adaptive(run, "pollux", interval_s=interval).bands[0].start_s
              for interval in (20.0, None)}
    assert ticked == {20.0: pytest.approx(10.0), None: pytest.approx(50.0)}
