"""``burst+demand``: plans for the background that is waiting, re-plans with hysteresis, no job demoted; the
pieces the multiplexing mode cuts a background step into; and the plan cache's key (issue 42)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest

from deeppool.cluster_sim.cluster import ClusterSpec
from deeppool.cluster_sim.engine import PolicyError, Simulation
from deeppool.cluster_sim.metrics import measure
from deeppool.cluster_sim.plans import PlanFacts, PlanMode
from deeppool.cluster_sim.runner import one_row, piece_ms
from deeppool.planner.profiling.interference import InterferenceModel, PieceMode, Pieces, cluster_shares
from deeppool.scheduling.contract import Decision, PlanOffer, Replan, Snapshot, Start
from deeppool.scheduling.demand import Hysteresis, best_plan
from deeppool.scheduling.policies import POLICIES

from .fakes import make_job

CLUSTER = ClusterSpec(gpus=8, gpus_per_node=4)
NO_INTERFERENCE = InterferenceModel(fg_slowdown=1.0, bg_efficiency=1.0, min_lend_fraction=0.0)
DEMAND = POLICIES["burst+demand"]


def menu_facts(model, gpus: int, mode: PlanMode) -> PlanFacts:
    """Data parallel 1/g s; the fastest plan 0.8/g s lending nothing; the lending plan 0.9/g s, ranks 1.. idle half."""
    if mode is PlanMode.DATA_PARALLEL or gpus == 1:
        return PlanFacts(iteration_s=1.0 / gpus, gpu_seconds_per_iteration=1.0, idle_fractions=(0.0,) * gpus)
    if mode is PlanMode.BURST:
        return PlanFacts(iteration_s=0.8 / gpus, gpu_seconds_per_iteration=0.8, idle_fractions=(0.0,) * gpus)
    iteration = 0.9 / gpus
    return PlanFacts(iteration_s=iteration, gpu_seconds_per_iteration=iteration * (gpus - 0.5 * (gpus - 1)),
                     idle_fractions=(0.0,) + (0.5,) * (gpus - 1))


def run(jobs, policy=DEMAND, *, replan_penalty_s=30.0, interference=NO_INTERFERENCE):
    return Simulation(cluster=CLUSTER, jobs=jobs, policy=policy, facts=menu_facts, interference=interference,
                      restart_penalty_s=0.0, replan_penalty_s=replan_penalty_s).run()


def by_id(result):
    return {r.job_id: r for r in result.records}


# ---- the objective counts only the background that is waiting ---------------------------------------

def offers(gpus: int = 8) -> dict[PlanMode, PlanOffer]:
    engine = Simulation(cluster=CLUSTER, jobs=[], policy=DEMAND, facts=menu_facts, interference=NO_INTERFERENCE,
                        restart_penalty_s=0.0)
    return {mode: engine.offer(menu_facts(None, gpus, mode), mode) for mode in PlanMode}


def test_the_objective_counts_background_work_only_up_to_the_demand() -> None:
    menu = offers()
    assert len(menu[PlanMode.LENDING].lendable) == 7 and not menu[PlanMode.BURST].lendable
    # no background waiting: the fastest plan (8 GPUs · T_dp / T = 10 against 8.9 for the lending plan)
    assert best_plan(menu, gpus=8, demand=0, margin=0.02)[:2] == (PlanMode.BURST, pytest.approx(10.0))
    # one waiting rank fills one window (8.9 + 0.5 = 9.4): still the fastest
    assert best_plan(menu, gpus=8, demand=1, margin=0.02)[0] is PlanMode.BURST
    # seven fill them all: 8.9 + 3.5 = 12.4, lending 7 ranks
    mode, value, lent = best_plan(menu, gpus=8, demand=7, margin=0.02)
    assert (mode, lent) == (PlanMode.LENDING, 7) and value == pytest.approx(8 / 0.9 + 3.5)
    # the planner's J is the same formula with every lendable rank counted
    fg, bg = cluster_shares(dp_ms=1.0, iteration_ms=0.9, hosting_ms=0.9, gpus=8, lent_usable=3.5)
    assert 8 * (fg + bg) == pytest.approx(value)


def test_no_background_waiting_gets_the_fastest_plan() -> None:
    jobs = [make_job(0, arrival=0, gpus=8, iterations=800), make_job(1, arrival=5, gpus=4, iterations=400)]
    demand, burst = run(jobs), run(jobs, POLICIES["burst"])
    assert demand.records == burst.records and demand.replans == 0
    assert by_id(demand)[0].jct_s == pytest.approx(800 * 0.1)


def test_background_waiting_at_a_start_gets_the_lending_plan_and_its_ranks() -> None:
    jobs = [make_job(0, arrival=0, gpus=8, iterations=4000),  # 450 s: done before its first re-plan could be
            *(make_job(i, arrival=0, gpus=1, iterations=50, background=True) for i in range(1, 8))]
    result = run(jobs)
    records = by_id(result)
    assert records[0].jct_s == pytest.approx(4000 * 0.9 / 8)  # the lending plan, no slowdown here
    assert all(records[i].start_s == 0.0 for i in range(1, 8))  # each guest on a lent rank from the start
    assert result.bg_gpu_s_in_windows == pytest.approx(7 * 50 * 1.0)
    assert result.replans == 0


def test_a_host_does_not_lend_when_the_slowdown_costs_more_than_the_waiting_work() -> None:
    slowed = InterferenceModel(fg_slowdown=1.25, bg_efficiency=0.8, min_lend_fraction=0.1)
    jobs = [make_job(0, arrival=0, gpus=8, iterations=800), make_job(1, arrival=1, gpus=1, iterations=10,
                                                                      background=True)]
    records = by_id(run(jobs, interference=slowed))
    assert records[1].start_s == pytest.approx(records[0].finish_s)  # it waits for whole GPUs
    assert records[0].jct_s == pytest.approx(800 * 0.1)  # the fastest plan, never slowed
    unconditional = by_id(run(jobs, POLICIES["burst+bg"], interference=slowed))
    assert unconditional[1].start_s == pytest.approx(1.0)  # burst+bg lends anyway


# ---- re-plans and their hysteresis ----------------------------------------------------------------

def test_background_arriving_moves_a_running_job_to_the_lending_plan_and_back_when_it_drains() -> None:
    hours = 8 * 3600 / 0.8  # iterations for about an hour on the fastest plan
    jobs = [make_job(0, arrival=0, gpus=8, iterations=hours),
            *(make_job(i, arrival=100, gpus=1, iterations=900, background=True) for i in range(1, 8))]
    result = run(jobs)
    assert result.replans == 2  # to the lending plan at the first tick after the dwell, back once they finished
    assert result.replan_gpu_s == pytest.approx(2 * 30.0 * 8)
    records = by_id(result)
    assert all(r.start_s == pytest.approx(600.0) for i, r in records.items() if i)  # lent at the re-plan
    assert result.bg_gpu_s_in_windows == pytest.approx(7 * 900 * 1.0)


def test_hysteresis_keeps_a_plan_for_its_dwell_whatever_the_background_does() -> None:
    """Short background jobs arriving every 50 s: demand flickers, re-plans stay at most one per dwell."""
    jobs = [make_job(0, arrival=0, gpus=8, iterations=8 * 36000 / 0.8)]  # ten hours
    jobs += [make_job(i, arrival=50.0 * i, gpus=1, iterations=60 if i % 3 else 2000, background=True)
             for i in range(1, 400)]
    result = run(jobs)
    dwell = Hysteresis().dwell_s
    assert 0 < result.replans <= result.makespan_s / dwell + 1
    assert len(result.records) == 400


def test_a_re_plan_costs_the_re_plan_penalty_at_the_new_rate() -> None:
    @dataclass(frozen=True)
    class MoveOnce:
        name: str = "move-once"

        def decide(self, snapshot: Snapshot) -> Decision:
            if snapshot.waiting:
                return Decision(start=(Start(job_id=0, gpus=8, mode=PlanMode.BURST),), wake_at_s=10.0)
            state = snapshot.plans.get(0)
            if snapshot.now_s == 10.0 and state is not None and state.mode is PlanMode.BURST:
                return Decision(replan=(Replan(job_id=0, mode=PlanMode.LENDING),))
            return Decision()

    result = run([make_job(0, arrival=0, gpus=8, iterations=800)], MoveOnce(), replan_penalty_s=20.0)
    done_before = 10.0 / 0.1
    assert result.records[0].finish_s == pytest.approx(10.0 + 20.0 + (800 - done_before) * 0.9 / 8)
    assert result.replans == 1 and result.replan_gpu_s == pytest.approx(20.0 * 8)


def test_a_re_plan_of_a_job_not_running_a_plan_is_a_policy_error() -> None:
    @dataclass(frozen=True)
    class Phantom:
        name: str = "phantom"

        def decide(self, snapshot: Snapshot) -> Decision:
            return Decision(replan=(Replan(job_id=0, mode=PlanMode.LENDING),))

    with pytest.raises(PolicyError, match="re-planned job 0, which is not running a plan"):
        run([make_job(0, arrival=0, gpus=8, iterations=8)], Phantom())


# ---- no job demoted ---------------------------------------------------------------------------------

def test_a_background_job_keeps_its_place_and_its_head_start() -> None:
    jobs = [make_job(0, arrival=0, gpus=6, iterations=600),                     # 6 GPUs until t=80
            make_job(1, arrival=1, gpus=1, iterations=100, background=True),    # its turn: a whole GPU until 101
            make_job(2, arrival=2, gpus=8, iterations=800),                     # waits for jobs 0 and 1
            make_job(3, arrival=3, gpus=1, iterations=200, background=True)]    # ahead of its turn, on the last GPU
    records = by_id(run(jobs))
    assert records[1].start_s == 1.0 and records[1].preemptions == 0           # never taken back: it came first
    assert records[3].start_s == 3.0 and records[3].preemptions == 1           # taken back for job 2
    assert records[2].start_s == pytest.approx(records[1].finish_s)
    prio = by_id(run(jobs, POLICIES["burst+prio"]))
    assert prio[1].preemptions == 1 and prio[2].start_s == pytest.approx(80.0)  # burst+prio demotes it


def test_demoted_jobs_are_reported_apart() -> None:
    jobs = [make_job(i, arrival=3 * i, gpus=(1, 2, 4, 8)[i % 4], iterations=80 + 10 * i, background=i % 4 == 0)
            for i in range(24)]
    result = run(jobs)
    m = measure(result)
    jct = np.array([r.jct_s for r in result.records])
    bg = np.array([r.background for r in result.records])
    assert m.p50_jct_s == pytest.approx(np.percentile(jct, 50))
    assert (m.p50_bg_jct_s, m.p99_bg_jct_s) == (pytest.approx(np.percentile(jct[bg], 50)),
                                                 pytest.approx(np.percentile(jct[bg], 99)))
    assert (m.p50_fg_jct_s, m.p99_fg_jct_s) == (pytest.approx(np.percentile(jct[~bg], 50)),
                                                 pytest.approx(np.percentile(jct[~bg], 99)))


# ---- pieces from the multiplexing mode ------------------------------------------------------------

def test_each_mode_sets_the_piece() -> None:
    guest = {"phase_ms": 10.1, "row_phase_ms": 0.2, "row_step_ms": 3.0}
    assert Pieces().piece_ms(**guest) == 0.5                                    # priority: DeepPool's 0.5 ms
    assert Pieces(target_ms=1.0).piece_ms(**guest) == 1.0
    assert Pieces().piece_ms(**{**guest, "row_phase_ms": 0.7}) == 0.7           # never below one layer phase
    assert Pieces(mode=PieceMode.GATE).piece_ms(**guest) == 3.0                 # a micro-step of one row
    assert Pieces(mode=PieceMode.LAYER).piece_ms(**guest) == 10.1               # the rule before pieces
    assert Pieces().planning_ms == 0.5 and Pieces(mode=PieceMode.GATE).planning_ms == 0.0
    with pytest.raises(Exception, match="--piece-ms"):
        Pieces(target_ms=0.0)


def test_the_planner_takes_the_piece_from_the_mode_interference_was_measured_in(tmp_path) -> None:
    import json

    measured = {"fg_slowdown": 1.02, "bg_efficiency": 0.9}
    for mode, piece, expected in (("priority", None, 0.5), ("priority", 0.25, 0.25), ("gate", None, 0.0)):
        path = tmp_path / f"{mode}-{piece}.json"
        path.write_text(json.dumps({**measured, "mode": mode, **({"piece_ms": piece} if piece else {})}))
        assert InterferenceModel.measured(path).bg_piece_ms == expected, (mode, piece)


def test_the_simulator_takes_a_guests_piece_from_its_own_plans(book, tiny) -> None:
    own = book.facts(tiny, 2, PlanMode.DATA_PARALLEL)
    row = book.facts(one_row(tiny), 1, PlanMode.DATA_PARALLEL)
    assert piece_ms(tiny, 2, book, Pieces(mode=PieceMode.LAYER)) == own.granularity_ms
    assert piece_ms(tiny, 2, book, Pieces(mode=PieceMode.GATE)) == pytest.approx(row.iteration_s * 1e3)
    assert piece_ms(tiny, 2, book, Pieces()) == max(0.5, row.granularity_ms)


def test_a_finer_piece_lets_a_guest_into_windows_a_coarse_one_cannot_use() -> None:
    def windows(model, gpus, mode):
        facts = menu_facts(model, gpus, mode)
        if mode is not PlanMode.LENDING or gpus == 1:
            return facts
        return replace(facts, idle_windows_ms=((),) + ((facts.iteration_s * 1e3 * 0.25,) * 2,) * (gpus - 1))

    window_ms = 0.9 / 8 * 1e3 * 0.25  # 28 ms
    jobs = [make_job(0, arrival=0, gpus=8, iterations=800)]
    jobs += [make_job(i, arrival=0, gpus=1, iterations=5, background=True) for i in range(1, 8)]
    for piece, lent in ((window_ms / 2, True), (window_ms * 2, False)):
        guests = [jobs[0], *(replace(job, granularity_ms=piece) for job in jobs[1:])]
        result = Simulation(cluster=CLUSTER, jobs=guests, policy=POLICIES["burst+bg"], facts=windows,
                            interference=NO_INTERFERENCE, restart_penalty_s=0.0).run()
        assert (result.lent_gpu_s > 0) is lent, piece


# ---- the plan cache's key ---------------------------------------------------------------------------

def test_the_plan_cache_key_follows_code_not_prose() -> None:
    from deeppool.cluster_sim.plans import _code

    source = 'def f(x):\n    """What f does."""\n    y = 1\n    """The y."""\n    return x + y\n'
    assert _code(source) == _code(source.replace("What f does.", "Something else entirely."))
    assert _code(source) == _code(source.replace("The y.", "") + "# a comment\n")
    assert _code(source) != _code(source.replace("y = 1", "y = 2"))


# ---- the command line ---------------------------------------------------------------------------------

def test_simulate_takes_the_piece_from_mux_and_says_which_jobs_are_background(tmp_path, data_dir) -> None:
    import json

    from typer.testing import CliRunner

    from deeppool.cluster_sim.cli import app

    args = ["synthetic", "--gpus", "8", "--gpus-per-node", "4", "--mapping", str(data_dir / "mapping.json"),
            "--jobs", "12", "--arrival-rate", "60", "--median-duration", "300", "--size-mix", "1:0.5,4:0.5",
            "--no-plots", "--cache-dir", str(tmp_path / "cache")]
    result = CliRunner().invoke(app, [*args, "--mux", "gate", "--out", str(tmp_path / "gate")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    run = json.loads((tmp_path / "gate" / "run.json").read_text())
    metrics = json.loads((tmp_path / "gate" / "metrics.json").read_text())
    assert list(metrics) == ["dp", "burst+demand"]  # the default policy, beside the baseline
    assert run["mux"] == "gate" and run["replan_penalty_s"] == 30.0
    assert run["interference"]["bg_piece_ms"] == 0.0  # gate's pieces depend on the guest: plans count every ms
    assert f"background jobs: {run['background_jobs']} of 12" in result.output and "gate mode" in result.output
    default = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "priority")], catch_exceptions=False)
    run = json.loads((tmp_path / "priority" / "run.json").read_text())
    assert run["mux"] == "priority" and run["interference"]["bg_piece_ms"] == 0.5, default.output
    bad = CliRunner().invoke(app, [*args, "--mux", "fast", "--out", str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "--mux 'fast': use priority, gate, layer" in bad.output
    assert len(bad.output.strip().splitlines()) == 1
