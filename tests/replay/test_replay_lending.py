"""A lending replay (``fifo-backfill:burst+bg``): one-GPU trace jobs are background jobs, and the simulator lends
them the idle ranks of the hosts' plans at the efficiency the live loans showed."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from deeppool.cluster_sim.models import load_mapping
from deeppool.cluster_sim.plans import PlanFacts
from deeppool.cluster_sim.shipped import resolve
from deeppool.cluster_sim.workload import BackgroundRule, read_workload
from deeppool.coordinator.jobs import JobStatus
from deeppool.replay.compare import compare, measured_loans, measured_speeds
from deeppool.replay.lending import lends
from deeppool.replay.live import LiveRecord, LiveRun
from deeppool.replay.plot import live_bands, place
from deeppool.replay.report import ReplayResult, loans_line, write
from deeppool.replay.slicing import SliceSettings, scale
from deeppool.scheduling import policy_named
from deeppool.scheduling.choice import ModelChoice

REPO = Path(__file__).resolve().parents[2]
MAPPING = REPO / "benchmarks" / "replay_models" / "mapping.json"


def _step_s(model: ModelChoice, gpus: int) -> float:
    return 0.2 / gpus


def _plan(model: ModelChoice, gpus: int) -> PlanFacts:
    """A plan on its first rank, the others idle the whole (predicted) 1 ms iteration: the shape the planner
    gives the replay's small models on several slots at a100 estimates."""
    return PlanFacts(iteration_s=1e-3, gpu_seconds_per_iteration=1e-3,
                     idle_fractions=(0.0,) + (1.0,) * (gpus - 1), idle_windows_ms=((),) + ((1.0,),) * (gpus - 1))


def test_one_gpu_trace_jobs_are_background_jobs_on_one_slot_under_a_lending_policy() -> None:
    workload = read_workload(resolve("workload-6"))
    settings = SliceSettings(slots=4, jobs=10, span_s=100.0, background=BackgroundRule())
    cut = scale(workload, settings, load_mapping(MAPPING), _step_s)
    assert [job.name for job in cut.jobs if job.background] == ["ncf-6", "ncf-7", "ncf-9"]
    assert all(job.gpus == 1 and job.step_s == pytest.approx(0.2) for job in cut.jobs if job.background)
    assert not any(job.background for job in scale(workload, replace(settings, background=None),
                                                   load_mapping(MAPPING), _step_s).jobs)
    assert lends(policy_named("fifo-backfill:burst+bg")) and not lends(policy_named("fifo-backfill"))


def test_a_guest_is_simulated_on_its_host_s_idle_rank_at_the_live_loans_efficiency(tmp_path: Path) -> None:
    """A 2-slot host (0.1 s a step, 1000 steps, 10 s of start-up) holds both slots 0-110 s; a background job (50
    steps of 0.2 s on a slot of its own, calibrated) made all its steps on the host's idle rank 5-45 s, one loan
    that started its processes (10 s of start-up, the median one-slot start-up): efficiency (50 x 0.2 + 10) / 40
    = 0.5. Simulated, it arrives at 1 s and is lent the idle rank at once: its 50 steps and its start-up (50
    steps' worth) at 0.5 / 0.2 = 2.5 steps a second take the same 40 s."""
    cut = scale(read_workload(resolve("workload-6")), SliceSettings(slots=2, jobs=2, span_s=1.0,
                                                                     background=BackgroundRule()),
                load_mapping(MAPPING), _step_s)
    host = replace(cut.jobs[0], gpus=2, steps=1000)
    guest = replace(cut.jobs[1], gpus=1, steps=50, step_s=0.2, background=True,
                    model=replace(cut.jobs[1].model, path=MAPPING.parent / "mlp.py"))
    run = LiveRun(url="http://live", slots=2, records=(
        LiveRecord(job=host, job_id=1, submitted_s=0.0, held=((0.0, 110.0),), state=JobStatus.SUCCEEDED,
                   reason="finished", iteration_s=0.1, hosts=(None,), gained=(1.0,)),
        LiveRecord(job=guest, job_id=2, submitted_s=1.0, held=((5.0, 45.0),), state=JobStatus.SUCCEEDED,
                   reason="finished", iteration_s=None, hosts=(1,), gained=(1.0,))))
    assert run.failed() == [] and run.records[1].lent_s == 40.0 and run.records[1].lent_steps() == 50.0
    speeds = measured_speeds(run)
    assert list(speeds) == [(str(host.model.path), host.batch, 2)]  # the guest's lent time is not a slot's speed
    loans = measured_loans(run, speeds, plan=_plan)
    assert (loans.lending.loans, loans.lending.guests) == (1, 1)
    assert loans.lending.efficiency == pytest.approx(0.5) and loans.lending.restart_s == pytest.approx(10.0)
    comparison, simulated, bands = compare(run, "fifo-backfill:burst+bg", speeds, lending=loans)
    ended = {record.name: (record.start_s, record.finish_s) for record in simulated.records}
    assert ended[host.name] == pytest.approx((0.0, 110.0))
    assert ended[guest.name] == pytest.approx((1.0, 41.0))
    assert comparison.makespan_gap == pytest.approx(0.0)
    assert [(band.name, band.lent, band.start_s, band.end_s) for band in bands] == [
        (host.name, False, 0.0, pytest.approx(110.0)), (guest.name, True, pytest.approx(1.0), pytest.approx(41.0))]
    assert [chosen for band, chosen in place(bands, 2) if band.lent] == [[2]]
    assert [band.lent for band in live_bands(run)] == [False, True]
    result = ReplayResult(slice=replace(cut, jobs=(host, guest)), live=run, speeds=speeds, comparison=comparison,
                          simulated=simulated, bands=tuple(bands), loans=loans)
    saved = json.loads(next(path for path in write(result, tmp_path) if path.suffix == ".json").read_text())
    assert saved["settings"]["background"] == "jobs asking for <= 1 GPU(s)"
    assert saved["lending"]["efficiency"] == pytest.approx(0.5)
    assert [job["hosts"] for job in saved["live"]] == [[None], [1]]
    assert "1 were lent a running job's idle ranks live (1 loans)" in loans_line(result)
