"""The event loop with fake Plan facts: exact rates, preemption, loans, determinism, custom policies."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from deeppool.cluster_sim.cluster import ClusterSpec
from deeppool.cluster_sim.engine import PolicyError, Simulation
from deeppool.cluster_sim.plans import PlanFacts, PlanMode
from deeppool.planner.profiling.interference import InterferenceModel
from deeppool.scheduling.contract import NOTHING, Decision, Lend, Snapshot, Start
from deeppool.scheduling.policies import ADAPTIVE, POLICIES

from .fakes import fake_facts, make_job

CLUSTER = ClusterSpec(gpus=8, gpus_per_node=4)
NO_INTERFERENCE = InterferenceModel(fg_slowdown=1.0, bg_efficiency=1.0, min_lend_fraction=0.0)


def run(jobs, policy, interference=NO_INTERFERENCE, cluster=CLUSTER, restart_penalty_s=0.0):
    return Simulation(cluster=cluster, jobs=jobs, policy=policy, facts=fake_facts, interference=interference,
                      restart_penalty_s=restart_penalty_s).run()


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
    """Co-adaptive policies run jobs by speed models, which these jobs lack: test_pollux_policy covers them."""
    jobs = [make_job(i, arrival=i, gpus=1 + i % 8, iterations=100, background=i % 2 == 0) for i in range(40)]
    for policy in (policy for name, policy in POLICIES.items() if name not in ADAPTIVE):
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


# ---- the contract the engine enforces -------------------------------------------------------------

@dataclass(frozen=True)
class ShortLoan:
    """Lends a two-GPU background job a single idle rank."""

    name: str = "short-loan"

    def decide(self, snapshot: Snapshot) -> Decision:
        starts = tuple(Start(job_id=j.job_id, gpus=j.gpus, mode=PlanMode.BURST) for j in snapshot.waiting_fg)
        if starts:
            return Decision(start=starts)
        slots = list(snapshot.free_slots)
        loans = tuple(Lend(job_id=j.job_id, slots=(slots[0],)) for j in snapshot.waiting_bg if slots)
        return Decision(lend=loans[:1]) if loans else NOTHING


def test_a_loan_of_fewer_ranks_than_the_job_asks_for_is_refused() -> None:
    jobs = [make_job(0, arrival=0, gpus=8, iterations=800), make_job(1, arrival=1, gpus=2, iterations=10, background=True)]
    with pytest.raises(PolicyError, match=r"policy 'short-loan' lent job 1 1 idle rank\(s\); it runs on exactly 2"):
        run(jobs, ShortLoan())


@dataclass(frozen=True)
class Clairvoyant:
    """Starts every job it has heard of, arrived or not."""

    ids: tuple[int, ...]
    name: str = "clairvoyant"

    def decide(self, snapshot: Snapshot) -> Decision:
        if snapshot.free_gpus < 1:
            return NOTHING
        return Decision(start=tuple(Start(job_id=i, gpus=1, mode=PlanMode.DATA_PARALLEL) for i in self.ids))


def test_a_start_before_arrival_is_refused() -> None:
    jobs = [make_job(0, arrival=0, gpus=1, iterations=10), make_job(1, arrival=50, gpus=1, iterations=10)]
    with pytest.raises(PolicyError, match=r"policy 'clairvoyant' placed job 1 before its arrival at t=50s"):
        run(jobs, Clairvoyant(ids=(0, 1)))


def overbusy_facts(model, gpus, mode):
    """A Plan claiming more GPU-time per iteration than its GPUs have."""
    return PlanFacts(iteration_s=1.0, gpu_seconds_per_iteration=2.0 * gpus, idle_fractions=(0.0,) * gpus)


def test_utilisation_above_100_percent_is_refused() -> None:
    jobs = [make_job(0, arrival=0, gpus=8, iterations=10)]
    engine = Simulation(cluster=CLUSTER, jobs=jobs, policy=POLICIES["dp"], facts=overbusy_facts,
                        interference=NO_INTERFERENCE, restart_penalty_s=0.0)
    with pytest.raises(PolicyError, match=r"policy 'dp' made 16.00 of 8 GPUs busy \(200%\)"):
        engine.run()


def test_evictions_are_counted_and_restarts_charged() -> None:
    jobs = [make_job(0, arrival=0, gpus=8, iterations=80), make_job(1, arrival=1, gpus=1, iterations=100, background=True)]
    free = run(jobs, POLICIES["burst+bg"])
    charged = run(jobs, POLICIES["burst+bg"], restart_penalty_s=30.0)
    guest_free, guest_charged = (next(r for r in result.records if r.job_id == 1) for result in (free, charged))
    assert guest_free.evictions == guest_charged.evictions == 1 and free.evictions == 1
    assert guest_charged.finish_s == pytest.approx(guest_free.finish_s + 30.0)
    assert charged.restart_penalty_gpu_s == pytest.approx(30.0) and free.restart_penalty_gpu_s == 0.0


def test_preemptions_are_charged_the_restart_penalty() -> None:
    jobs = [make_job(0, arrival=0, gpus=1, iterations=100, background=True), make_job(2, arrival=10, gpus=8, iterations=80)]
    records = {r.job_id: r for r in run(jobs, POLICIES["dp+bg"], restart_penalty_s=30.0).records}
    assert records[0].preemptions == 1
    assert records[0].finish_s == pytest.approx(20.0 + 30.0 + 90.0)


def test_lent_time_and_work_in_windows_are_measured() -> None:
    jobs = [make_job(0, arrival=0, gpus=8, iterations=1000), make_job(1, arrival=1, gpus=1, iterations=10, background=True)]
    result = run(jobs, POLICIES["burst+bg"])
    guest = next(r for r in result.records if r.job_id == 1)
    assert result.lent_gpu_s == pytest.approx(guest.jct_s)               # one rank lent while the guest ran
    assert result.bg_gpu_s_in_windows == pytest.approx(10 * 1.0)        # 10 iterations of 1 GPU-second each
    plain = run(jobs, POLICIES["burst"])
    assert plain.lent_gpu_s == 0.0 and plain.bg_gpu_s_in_windows == 0.0


def test_a_guest_whose_steps_fit_no_window_is_not_lent() -> None:
    coarse = replace(make_job(1, arrival=1, gpus=1, iterations=10, background=True), granularity_ms=1e6)
    jobs = [make_job(0, arrival=0, gpus=8, iterations=800), coarse]
    records = {r.job_id: r for r in run(jobs, POLICIES["burst+bg"]).records}
    assert records[1].start_s == pytest.approx(records[0].finish_s)


def test_a_guest_needing_more_memory_than_the_lent_gpu_has_is_not_lent() -> None:
    big = replace(make_job(1, arrival=1, gpus=1, iterations=10, background=True), memory_bytes=2**50)
    jobs = [make_job(0, arrival=0, gpus=8, iterations=800), big]
    records = {r.job_id: r for r in run(jobs, POLICIES["burst+bg"]).records}
    assert records[1].start_s == pytest.approx(records[0].finish_s)


# ---- scheduling orders -----------------------------------------------------------------------------

def test_fifo_backfill_starts_a_job_that_fits_behind_a_blocked_head() -> None:
    jobs = [
        make_job(0, arrival=0, gpus=6, iterations=600),
        make_job(1, arrival=1, gpus=4, iterations=400),
        make_job(2, arrival=2, gpus=2, iterations=200),
    ]
    records = {r.job_id: r for r in run(jobs, POLICIES["fifo-backfill"]).records}
    assert records[2].start_s == 2.0 and records[1].start_s == pytest.approx(100.0)


def test_tiresias_demotes_a_long_job_and_preempts_it_for_a_new_one() -> None:
    threshold_s = 16 * 3600 / 8  # 8 GPUs reach 16 GPU-hours after two hours
    jobs = [make_job(0, arrival=0, gpus=8, iterations=8 * 3 * threshold_s), make_job(1, arrival=threshold_s + 100, gpus=8, iterations=800)]
    records = {r.job_id: r for r in run(jobs, POLICIES["tiresias"], restart_penalty_s=30.0).records}
    assert records[1].start_s == pytest.approx(threshold_s + 100)  # job 0 is in the second queue by then
    assert records[0].preemptions == 1
    assert records[0].finish_s == pytest.approx(3 * threshold_s + 100 + 30.0)
    fifo = {r.job_id: r for r in run(jobs, POLICIES["dp"]).records}
    assert fifo[1].start_s == pytest.approx(3 * threshold_s)


def test_tiresias_keeps_a_young_job_running() -> None:
    jobs = [make_job(0, arrival=0, gpus=8, iterations=800), make_job(1, arrival=10, gpus=8, iterations=80)]
    records = {r.job_id: r for r in run(jobs, POLICIES["tiresias"]).records}
    assert records[0].preemptions == 0 and records[1].start_s == pytest.approx(100.0)


def test_order_and_placement_are_separate_axes() -> None:
    assert {"dp", "burst", "burst+bg", "dp+bg", "fifo-backfill", "tiresias", "tiresias:burst+bg"} <= set(POLICIES)
    jobs = [make_job(i, arrival=i, gpus=1 + i % 8, iterations=100, background=i % 2 == 0) for i in range(40)]
    for name in ("tiresias:burst", "tiresias:burst+bg", "fifo-backfill:dp+bg"):
        assert len(run(jobs, POLICIES[name]).records) == 40, name


def test_tiresias_never_lends_the_ranks_of_a_host_it_preempts() -> None:
    threshold_s = 16 * 3600 / 8
    jobs = [
        make_job(0, arrival=0, gpus=8, iterations=8 * 3 * threshold_s),          # demoted after two hours
        make_job(1, arrival=threshold_s + 100, gpus=8, iterations=800),          # preempts it
        *(make_job(2 + i, arrival=threshold_s + 100, gpus=1, iterations=1e6, background=True) for i in range(8)),
    ]
    result = run(jobs, POLICIES["tiresias:burst+bg"], restart_penalty_s=30.0)
    assert len(result.records) == 10
    assert next(r for r in result.records if r.job_id == 0).preemptions == 1


def test_burst_prio_is_burst_bg_without_loans() -> None:
    jobs = [make_job(0, arrival=0, gpus=8, iterations=800), make_job(1, arrival=1, gpus=1, iterations=10, background=True)]
    lent = run(jobs, POLICIES["burst+bg"])
    unlent = run(jobs, POLICIES["burst+prio"])
    assert lent.lent_gpu_s > 0 and unlent.lent_gpu_s == 0.0
    fg = next(r for r in unlent.records if r.job_id == 0)
    assert next(r for r in unlent.records if r.job_id == 1).start_s == pytest.approx(fg.finish_s)
