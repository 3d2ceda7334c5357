"""The event loop with fake Plan facts: exact rates, preemption, loans, determinism, custom policies."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from deeppool.cluster_sim.cluster import ClusterSpec
from deeppool.cluster_sim.engine import Engine, PolicyError
from deeppool.cluster_sim.interference import InterferenceModel
from deeppool.cluster_sim.plans import PlanMode
from deeppool.cluster_sim.policies import POLICIES
from deeppool.cluster_sim.policy import NOTHING, Decision, Snapshot, Start

from .fakes import fake_facts, make_job

CLUSTER = ClusterSpec(gpus=8, gpus_per_node=4)
NO_INTERFERENCE = InterferenceModel(fg_slowdown=1.0, bg_efficiency=1.0, min_lend_fraction=0.0)


def run(jobs, policy, interference=NO_INTERFERENCE, cluster=CLUSTER):
    return Engine(cluster=cluster, jobs=jobs, policy=policy, facts=fake_facts, interference=interference).run()


def test_single_job_runs_at_its_plan_rate() -> None:
    jobs = [make_job(0, arrival=10.0, gpus=4, iterations=400)]
    dp = run(jobs, POLICIES["dp"]).records[0]
    burst = run(jobs, POLICIES["burst"]).records[0]
    assert dp.start_s == 10.0
    assert dp.jct_s == pytest.approx(400 * fake_facts(None, 4, PlanMode.DATA_PARALLEL).iteration_s)
    assert burst.jct_s == pytest.approx(400 * fake_facts(None, 4, PlanMode.BURST).iteration_s)


def test_fifo_head_blocks_and_gpus_are_freed() -> None:
    jobs = [
        make_job(0, arrival=0, gpus=6, iterations=600),   # 100 s on 6 GPUs
        make_job(1, arrival=1, gpus=4, iterations=400),   # must wait for job 0
        make_job(2, arrival=2, gpus=2, iterations=200),   # fits, but FIFO: waits behind job 1
    ]
    records = {r.job_id: r for r in run(jobs, POLICIES["dp"]).records}
    assert records[1].start_s == pytest.approx(100.0)
    assert records[2].start_s == pytest.approx(100.0)
    assert records[1].finish_s == pytest.approx(200.0)


def test_background_job_borrows_idle_ranks_at_the_interference_rate() -> None:
    model = InterferenceModel(fg_slowdown=1.25, bg_efficiency=0.8, min_lend_fraction=0.1)
    jobs = [
        make_job(0, arrival=0, gpus=8, iterations=1000),                   # fills the cluster
        make_job(1, arrival=1, gpus=1, iterations=10, background=True),    # runs on a lent rank
    ]
    result = run(jobs, POLICIES["burst+bg"], interference=model)
    fg, bg = sorted(result.records, key=lambda r: r.job_id)
    bg_rate = 0.8 * 0.5 / 1.0  # efficiency · idle fraction / own one-GPU iteration time
    assert bg.start_s == 1.0
    assert bg.jct_s == pytest.approx(10 / bg_rate)
    iteration = fake_facts(None, 8, PlanMode.BURST).iteration_s
    hosted = bg.jct_s / (iteration * 1.25)
    before = 1.0 / iteration  # iterations done before the guest arrived
    assert fg.finish_s == pytest.approx(1.0 + bg.jct_s + (1000 - before - hosted) * iteration)  # 105 s


def test_no_loan_without_idle_ranks_and_no_loan_under_plain_policies() -> None:
    jobs = [make_job(0, arrival=0, gpus=8, iterations=800), make_job(1, arrival=1, gpus=1, iterations=1, background=True)]
    for name in ("dp", "burst", "dp+bg"):
        records = {r.job_id: r for r in run(jobs, POLICIES[name]).records}
        assert records[1].start_s == pytest.approx(records[0].finish_s), name


def test_foreground_preempts_background_on_whole_gpus_and_work_is_kept() -> None:
    jobs = [
        make_job(0, arrival=0, gpus=1, iterations=100, background=True),  # alone: takes a whole GPU
        make_job(1, arrival=0, gpus=7, iterations=140, background=True),
        make_job(2, arrival=10, gpus=8, iterations=80),                     # needs every GPU
    ]
    records = {r.job_id: r for r in run(jobs, POLICIES["dp+bg"]).records}
    assert records[2].start_s == 10.0
    assert records[0].preemptions == 1 and records[1].preemptions == 1
    assert records[2].finish_s == pytest.approx(20.0)
    assert records[0].finish_s == pytest.approx(20.0 + 90.0)  # 10 iterations done before, 90 after
    assert records[1].finish_s == pytest.approx(20.0 + 70 / 7)


def test_guest_is_evicted_when_its_host_finishes_and_resumes() -> None:
    jobs = [
        make_job(0, arrival=0, gpus=8, iterations=80),                      # burst: 8 s
        make_job(1, arrival=1, gpus=1, iterations=100, background=True),
    ]
    records = {r.job_id: r for r in run(jobs, POLICIES["burst+bg"]).records}
    host_end = records[0].finish_s
    done_as_guest = (host_end - 1.0) * 0.5
    assert records[1].finish_s == pytest.approx(host_end + (100 - done_as_guest))


def test_runs_are_deterministic() -> None:
    jobs = [make_job(i, arrival=(i * 7) % 13, gpus=1 + i % 4, iterations=50 + i, background=i % 3 == 0) for i in range(60)]
    first = run(jobs, POLICIES["burst+bg"])
    second = run(jobs, POLICIES["burst+bg"])
    assert first.records == second.records and first.timeline == second.timeline


def test_every_policy_completes_every_job() -> None:
    jobs = [make_job(i, arrival=i, gpus=1 + i % 8, iterations=100, background=i % 2 == 0) for i in range(40)]
    for policy in POLICIES.values():
        result = run(jobs, policy)
        assert len(result.records) == 40, policy.name
        assert 0 < result.busy_gpu_s <= CLUSTER.gpus * result.makespan_s + 1e-6


@dataclass(frozen=True)
class SmallestFirst:
    """A policy the engine has never heard of: smallest waiting job first, no blocking."""

    name: str = "smallest-first"

    def decide(self, snapshot: Snapshot) -> Decision:
        fitting = sorted((j for j in snapshot.waiting if j.gpus <= snapshot.free_gpus), key=lambda j: (j.gpus, j.job_id))
        if not fitting:
            return NOTHING
        job = fitting[0]
        return Decision(start=(Start(job_id=job.job_id, gpus=job.gpus, mode=PlanMode.DATA_PARALLEL),))


def test_a_new_policy_needs_no_engine_change() -> None:
    jobs = [make_job(0, arrival=0, gpus=8, iterations=80), make_job(1, arrival=1, gpus=8, iterations=8), make_job(2, arrival=1, gpus=1, iterations=1)]
    records = {r.job_id: r for r in run(jobs, SmallestFirst()).records}
    assert records[2].start_s < records[1].start_s


@dataclass(frozen=True)
class Broken:
    name: str = "broken"

    def decide(self, snapshot: Snapshot) -> Decision:
        return Decision(start=tuple(Start(job_id=j.job_id, gpus=99, mode=PlanMode.BURST) for j in snapshot.waiting))


def test_an_impossible_decision_is_a_policy_error() -> None:
    with pytest.raises(PolicyError, match="99 GPUs"):
        run([make_job(0, arrival=0, gpus=1, iterations=1)], Broken())


def test_a_guest_moves_to_whole_gpus_when_they_free_up() -> None:
    jobs = [
        make_job(0, arrival=0, gpus=4, iterations=4000),                   # hosts the guest throughout
        make_job(1, arrival=0, gpus=4, iterations=40),                     # burst: 0.2 s/it, done at 8 s
        make_job(2, arrival=1, gpus=1, iterations=100, background=True),   # a guest until 4 GPUs free up
    ]
    records = {r.job_id: r for r in run(jobs, POLICIES["burst+bg"]).records}
    assert records[1].finish_s == pytest.approx(8.0)
    assert records[2].preemptions == 1
    assert records[2].finish_s == pytest.approx(8.0 + (100 - 7.0 * 0.5))


def test_stale_completions_neither_count_nor_stretch_the_makespan() -> None:
    jobs = [make_job(0, arrival=0, gpus=8, iterations=1000), make_job(1, arrival=1, gpus=1, iterations=10, background=True)]
    model = InterferenceModel(fg_slowdown=2.0, bg_efficiency=1.0, min_lend_fraction=0.0)
    result = run(jobs, POLICIES["burst+bg"], interference=model)
    assert result.makespan_s == pytest.approx(max(r.finish_s for r in result.records))
    assert result.events == 4  # two arrivals, two completions
