"""The co-adaptive ``pollux`` policy on the Pollux artifact's measured applications (real speed models).

The policy is a pure function of a snapshot, so its choices are checked on hand-built snapshots; the engine
runs it on real workload-6 jobs for the end-to-end behaviour.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from deeppool.cluster_sim.cluster import ClusterSpec
from deeppool.cluster_sim.engine import PolicyError, Simulation
from deeppool.cluster_sim.plans import PlanMode
from deeppool.cluster_sim.pollux import PolluxDurations
from deeppool.cluster_sim.workload import read_workload
from deeppool.planner.profiling.interference import InterferenceModel
from deeppool.scheduling.contract import NOTHING, Adaptive, Decision, Rebatch, Snapshot, Start
from deeppool.scheduling.policies import POLICIES
from deeppool.scheduling.pollux import PolluxPolicy

from .conftest import TRACES
from .fakes import fake_facts, make_job

POLICY = PolluxPolicy()


@pytest.fixture(scope="module")
def apps() -> PolluxDurations:
    return PolluxDurations(root=TRACES / "traces")


def speed_job(apps: PolluxDurations, job_id: int, application: str, *, arrival: float = 0.0, gpus: int = 1):
    return replace(make_job(job_id, arrival=arrival, gpus=gpus, iterations=1.0),
                   speed=apps.application(application, where="test"))


def snapshot(now: float, total: int, running: dict, waiting: list, adaptive: dict) -> Snapshot:
    """``running``: job -> GPUs held."""
    holding = {job.job_id: gpus for job, gpus in running.items()}
    return Snapshot(now_s=now, total_gpus=total, free_gpus=total - sum(holding.values()), waiting=waiting,
                    waiting_fg=waiting, waiting_bg=[], free_slots=(), preemptible=[], preemptible_gpus=0, guests=[],
                    holding=holding, running=list(running), requeued=[],
                    attained_gpu_s={job.job_id: 0.0 for job in running}, adaptive=adaptive)


def decide_alone(apps, *, epoch: int, restarts: int = 0, age: float = 3600.0) -> Decision:
    """A cifar10 job that has run on 4 GPUs, alone on 16, at the start of ``epoch``."""
    job = speed_job(apps, 0, "cifar10")
    speed = job.speed
    state = Adaptive(progress=speed.progress_at(epoch), batch=speed.best_batch(4, epoch)[0], restarts=restarts,
                     peak_gpus=4)
    return POLICY.decide(snapshot(age, 16, {job: 4}, [], {0: state}))


def test_a_large_noise_scale_grows_the_job_and_its_batch(apps) -> None:
    early, late = decide_alone(apps, epoch=0), decide_alone(apps, epoch=60)
    assert early.start == () and early.preempt == ()  # early in training a bigger batch does not pay
    assert late.preempt == (0,) and len(late.start) == 1
    grown = late.start[0]
    assert grown.gpus == 8  # twice the most it has held: the artifact's exploration limit
    assert grown.batch > apps.application("cifar10", where="test").best_batch(4, 0)[0]


def test_a_job_restarted_often_keeps_its_gpus(apps) -> None:
    # age 600 s, 20 restarts: the restart factor max(age - 20 * 30, 0) / (age + 30) is 0
    kept = decide_alone(apps, epoch=60, restarts=20, age=600.0)
    assert kept.preempt == () and kept.start == ()


def test_every_waiting_job_gets_a_gpu_before_any_gets_a_second(apps) -> None:
    jobs = [speed_job(apps, i, "cifar10", arrival=0.0) for i in range(6)]
    decision = POLICY.decide(snapshot(120.0, 8, {}, jobs, {}))
    assert sorted(start.job_id for start in decision.start) == list(range(6))
    assert sum(start.gpus for start in decision.start) <= 8
    assert all(isinstance(start, Start) and start.batch for start in decision.start)


def test_between_ticks_it_only_asks_to_be_woken(apps) -> None:
    job = speed_job(apps, 0, "cifar10")
    decision = POLICY.decide(snapshot(90.0, 8, {}, [job], {}))
    assert decision.empty and decision.wake_at_s == 120.0


def run(jobs, policy: str, gpus: int = 64):
    return Simulation(cluster=ClusterSpec(gpus=gpus, gpus_per_node=4), jobs=jobs, policy=POLICIES[policy],
                      facts=fake_facts, interference=InterferenceModel(), restart_penalty_s=30.0).run()


def workload_6_jobs(apps, count: int | None = None):
    workload = read_workload(TRACES / "workloads" / "workload-6.csv")
    return [replace(make_job(index, arrival=job.arrival_s, gpus=job.gpus,
                             iterations=job.duration_s / fake_facts(None, job.gpus, PlanMode.DATA_PARALLEL).iteration_s),
                    name=job.name, speed=apps.application(job.key, where=job.where))
            for index, job in enumerate(workload.jobs[:count])]


def test_a_lone_fixed_job_runs_its_derived_duration_after_the_first_tick(apps) -> None:
    """ncf keeps batch 32,768 on 1 GPU: the engine's epoch-by-epoch progress equals the run-time derivation."""
    record, = run([speed_job(apps, 0, "ncf", arrival=0.0)], "pollux").records
    duration = apps.duration_s("ncf", 1, 32768, where="test")
    assert record.start_s == 60.0  # at t=0 its age is 0, so the restart factor makes it wait one tick
    assert record.finish_s == pytest.approx(60.0 + duration, rel=1e-9)


def test_on_a_slice_of_workload_6_it_beats_fixed_allocations_and_pays_for_restarts(apps) -> None:
    jobs = workload_6_jobs(apps, 40)
    results = {name: run(jobs, name, gpus=32) for name in ("pollux", "tiresias", "fifo-backfill")}
    jct = {name: np.mean([r.jct_s for r in result.records]) for name, result in results.items()}
    assert all(len(result.records) == 40 for result in results.values())
    assert jct["pollux"] < 0.8 * min(jct["tiresias"], jct["fifo-backfill"])
    pollux = results["pollux"]
    assert pollux.preemptions > 0 and pollux.restart_penalty_gpu_s >= 30.0 * pollux.preemptions


def test_the_engine_refuses_a_batch_for_a_job_without_a_speed_model() -> None:
    class StartWithBatch:
        name = "start-with-batch"

        def decide(self, snap: Snapshot) -> Decision:
            return Decision(start=tuple(Start(job_id=j.job_id, gpus=1, mode=PlanMode.DATA_PARALLEL, batch=64)
                                        for j in snap.waiting))

    engine = Simulation(cluster=ClusterSpec(gpus=4, gpus_per_node=4),
                        jobs=[make_job(0, arrival=0, gpus=1, iterations=5)], policy=StartWithBatch(), facts=fake_facts,
                        interference=InterferenceModel(), restart_penalty_s=30)
    with pytest.raises(PolicyError, match="no speed model"):
        engine.run()


class StartThenRebatch:
    """Start job 0 on 4 GPUs at ``first``; at t=60 change its batch to ``second`` (no restart)."""

    name = "start-then-rebatch"

    def __init__(self, first: int, second: int | None) -> None:
        self.first, self.second = first, second

    def decide(self, snap: Snapshot) -> Decision:
        if snap.waiting:
            return Decision(start=(Start(job_id=0, gpus=4, mode=PlanMode.DATA_PARALLEL, batch=self.first),),
                            wake_at_s=60.0)
        state = snap.adaptive.get(0)
        if self.second is not None and snap.now_s == 60.0 and state is not None and state.batch != self.second:
            return Decision(rebatch=(Rebatch(job_id=0, batch=self.second),))
        return NOTHING


def progress_after(speed, gpus: int, batch: int, seconds: float) -> float:
    """Progress from 0 after ``seconds`` at a fixed batch, epoch by epoch (the speed model, by hand)."""
    done = 0.0
    for epoch in range(speed.epoch_at(speed.total_progress) + 1):
        rate = speed.goodput(gpus, batch, epoch)
        span = speed.progress_at(epoch + 1) - done
        if span / rate >= seconds:
            return done + rate * seconds
        done, seconds = done + span, seconds - span / rate
    return done


def seconds_between(speed, gpus: int, batch: int, start: float) -> float:
    """Seconds from progress ``start`` to the end at a fixed batch."""
    total = 0.0
    for epoch in range(speed.epoch_at(start), speed.epoch_at(speed.total_progress) + 1):
        begin = max(start, speed.progress_at(epoch))
        total += (speed.progress_at(epoch + 1) - begin) / speed.goodput(gpus, batch, epoch)
    return total


def test_a_batch_change_takes_effect_without_a_restart(apps) -> None:
    engine = Simulation(cluster=ClusterSpec(gpus=4, gpus_per_node=4), jobs=[speed_job(apps, 0, "cifar10")],
                        policy=StartThenRebatch(128, 1024), facts=fake_facts, interference=InterferenceModel(),
                        restart_penalty_s=30.0)
    result = engine.run()
    speed = apps.application("cifar10", where="test")
    expected = 60.0 + seconds_between(speed, 4, 1024, progress_after(speed, 4, 128, 60.0))
    assert result.preemptions == 0 and result.restart_penalty_gpu_s == 0.0
    assert result.records[0].finish_s == pytest.approx(expected, rel=1e-9)
    assert result.records[0].finish_s < seconds_between(speed, 4, 1024, 0.0)  # small early, large later pays
