"""DeepPool's evaluation scenario: one foreground job, unlimited background jobs, on the real planner's Plans."""

from __future__ import annotations

import pytest

from deeppool.cluster_sim.plans import PlanMode
from deeppool.cluster_sim.scenario import evaluate, scenario_models
from deeppool.planner.profiling.interference import InterferenceModel


@pytest.mark.parametrize("gpus", [4, 8])
def test_cluster_throughput_is_foreground_plus_work_in_lent_windows(book, tiny, gpus) -> None:
    generous = InterferenceModel(fg_slowdown=1.0, bg_efficiency=1.0, min_lend_fraction=0.0)
    point = evaluate(tiny, gpus, gpus_per_node=4, book=book, interference=generous)
    foreground, background = scenario_models(tiny, gpus)
    piece = book.facts(background, 1, PlanMode.DATA_PARALLEL).granularity_ms
    hosting = book.hosting(piece)  # the lent plan is chosen for the guests' pieces
    assert piece > 0 and hosting.settings.interference.bg_piece_ms == piece
    dp, burst = (hosting.facts(foreground, gpus, mode) for mode in (PlanMode.DATA_PARALLEL, PlanMode.LENDING))
    assert point.fg_share == pytest.approx(dp.iteration_s / burst.iteration_s)  # no slowdown: the lent plan's speed
    assert point.cluster_throughput_vs_dp == pytest.approx(point.fg_share + point.bg_share)
    assert 0 <= point.bg_share <= point.lent_fraction * (1 + 1e-12) <= 1 + 1e-12
    assert point.guests <= gpus
    assert point.right_sizing_vs_dp >= 1.0 and 1 <= point.right_sizing_gpus <= gpus
    assert point.vs_right_sizing == pytest.approx(point.cluster_throughput_vs_dp / point.right_sizing_vs_dp)
    assert point.bg_gpu_hours_in_windows <= point.lent_gpu_hours * (1 + 1e-12)


def test_the_lent_plan_is_chosen_for_cluster_throughput_and_the_fastest_stays_for_burst(book, tiny) -> None:
    foreground, _ = scenario_models(tiny, 8)
    fastest, lent = (book.facts(foreground, 8, mode) for mode in (PlanMode.BURST, PlanMode.LENDING))
    assert fastest.iteration_s <= lent.iteration_s * (1 + 1e-12)
    assert lent.right_sizing_throughput >= 1.0 and fastest.right_sizing_gpus == lent.right_sizing_gpus


def test_no_window_filled_means_no_background_share(book, tiny) -> None:
    nothing = InterferenceModel(fg_slowdown=1.0, bg_efficiency=1.0, efficiency_by_window_ms=((1e9, 1.0),))
    point = evaluate(tiny, 8, gpus_per_node=4, book=book, interference=nothing)
    assert point.bg_share == 0.0 and point.lent_fraction == 0.0 and point.guests == 0
