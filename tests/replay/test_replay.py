"""The replay's scaling and its simulated half, on the shipped Pollux workload (the live half:
tests/coordinator/test_replay_live.py)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from deeppool.cluster_sim.models import load_mapping
from deeppool.cluster_sim.shipped import resolve
from deeppool.cluster_sim.workload import read_workload
from deeppool.coordinator.jobs import JobStatus
from deeppool.errors import DeeppoolError
from deeppool.replay.compare import compare, measured_speeds
from deeppool.replay.live import LiveRecord, LiveRun, measured_iteration_s
from deeppool.replay.plot import place, simulated_bands
from deeppool.replay.slicing import ReplayJob, SliceSettings, measure_step_s, scale, sharing_cores
from deeppool.scheduling.choice import ModelChoice

REPO = Path(__file__).resolve().parents[2]
MAPPING = REPO / "benchmarks" / "replay_models" / "mapping.json"


def _step_s(model: ModelChoice, gpus: int) -> float:
    """A step time per model file, smaller on more slots (what :func:`measure_step_s` gives, without torch)."""
    return {"cnn": 0.08, "mlp": 0.02, "recurrent": 0.04, "resnet18": 0.2}[model.name] / gpus


def test_a_slice_is_compressed_by_one_factor_and_fits_the_slots() -> None:
    workload = read_workload(resolve("workload-6"))
    settings = SliceSettings(slots=4, first=3, jobs=20, span_s=300.0, min_run_s=3.0, max_run_s=60.0)
    cut = scale(workload, settings, load_mapping(MAPPING), _step_s)
    trace = workload.jobs[3:23]
    assert [job.name for job in cut.jobs] == [job.name for job in trace]
    assert cut.jobs[0].arrival_s == 0.0 and cut.jobs[-1].arrival_s == pytest.approx(300.0)
    for job, row in zip(cut.jobs, trace, strict=True):
        assert job.arrival_s == pytest.approx((row.arrival_s - trace[0].arrival_s) * cut.time_scale)
        assert job.run_s == pytest.approx(min(60.0, max(3.0, row.duration_s * cut.time_scale)))
        assert 1 <= job.gpus <= 4 and job.steps >= settings.min_steps
    largest = max(trace, key=lambda row: row.gpus)
    assert next(job for job in cut.jobs if job.name == largest.name).gpus == 4
    assert cut.gpu_scale == largest.gpus / 4


def test_a_slice_past_the_trace_or_at_one_instant_is_refused() -> None:
    workload = read_workload(resolve("workload-6"))
    with pytest.raises(DeeppoolError, match="runs past its end"):
        scale(workload, SliceSettings(slots=2, first=150, jobs=20), load_mapping(MAPPING), _step_s)
    with pytest.raises(DeeppoolError, match="at least 2"):
        SliceSettings(slots=2, jobs=1)


def _record(job: ReplayJob, job_id: int, submitted: float, start: float, end: float, iteration: float) -> LiveRecord:
    return LiveRecord(job=job, job_id=job_id, submitted_s=submitted, held=((start, end),), state=JobStatus.SUCCEEDED,
                      reason="finished", iteration_s=iteration)


def test_the_simulation_queues_the_live_jobs_by_the_speeds_they_measured() -> None:
    """Two one-slot jobs of one model on one slot: each held its slot 10 s (2 s of start-up, 80 steps of
    0.1 s), the second waited for the first. The simulator, given their medians, does the same."""
    cut = scale(read_workload(resolve("workload-6")), SliceSettings(slots=1, jobs=2, span_s=1.0),
                load_mapping(MAPPING), _step_s)
    jobs = [replace(job, steps=80) for job in cut.jobs]
    run = LiveRun(url="http://live", slots=1, records=(_record(jobs[0], 1, 0.0, 0.5, 10.5, 0.1),
                                                       _record(jobs[1], 2, 1.0, 10.6, 20.6, 0.1)))
    speeds = measured_speeds(run)
    (speed,) = speeds.values()
    assert speed.iteration_s == pytest.approx(0.1) and speed.start_up_s == pytest.approx(2.0) and speed.jobs == 2
    comparison, simulated, bands = compare(run, "fifo-backfill", speeds)
    assert not any(band.lent for band in bands)  # every job a foreground job
    assert [(r.start_s, r.finish_s) for r in simulated.records] == [pytest.approx((0.0, 10.0)),
                                                                   pytest.approx((10.0, 20.0))]
    assert comparison.live.average_jct_s == pytest.approx((10.5 + 19.6) / 2)
    assert comparison.simulated.makespan_s == pytest.approx(20.0) and comparison.live.makespan_s == 20.6
    assert comparison.steps_only.makespan_s == pytest.approx(16.0)
    assert [chosen for _, chosen in place(simulated_bands(simulated), 1)] == [[0], [0]]


def test_a_job_that_failed_leaves_its_speed_unknown_and_the_replay_says_which() -> None:
    cut = scale(read_workload(resolve("workload-6")), SliceSettings(slots=1, jobs=2, span_s=1.0),
                load_mapping(MAPPING), _step_s)
    failed = LiveRecord(job=cut.jobs[1], job_id=7, submitted_s=1.0, held=((1.0, 3.0),), state=JobStatus.FAILED,
                        reason="exited with code 1", iteration_s=None)
    run = LiveRun(url="http://live", slots=1, records=(_record(cut.jobs[0], 6, 0.0, 0.0, 5.0, 0.1), failed))
    with pytest.raises(DeeppoolError, match=r"cifar10-1 \(job 7\) FAILED: exited with code 1"):
        measured_speeds(run)


def test_the_iteration_time_is_read_from_the_run_s_summary_line() -> None:
    log = "steps: 50 (45 measured after warm-up) on 2 ranks\niteration: measured 64.875 ms, predicted 0.362 ms\n"
    assert measured_iteration_s(log) == pytest.approx(0.064875)
    assert measured_iteration_s("error: the model failed to import\n") is None


def test_a_step_is_timed_here_on_one_thread_and_shared_cores_slow_it() -> None:
    mlp = ModelChoice(name="mlp", path=REPO / "benchmarks" / "models" / "mlp.py", global_batch=64)
    alone = measure_step_s(mlp, 2, steps=3)
    assert 0 < alone < 10
    shared = sharing_cores(lambda model, gpus: alone, cores=1)
    assert shared(mlp, 1) == alone and shared(mlp, 4) == 4 * alone
