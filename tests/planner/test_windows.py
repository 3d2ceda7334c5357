"""Short-window cuts (:mod:`deeppool.planner.solve.windows`): what they price as unusable never exceeds the idle time
that a guest's pieces cannot use, on every assignment, and they tighten the cluster search's bound."""

from __future__ import annotations

import itertools

import pytest

from deeppool.planner.profiling.interference import _fit
from deeppool.planner.solve.build import rank_idle_windows
from deeppool.planner.solve.cost import CostModel, SlotKind
from deeppool.planner.solve.ilp import Ilp
from deeppool.planner.solve.windows import WindowCuts
from tests.planner.test_ilp import CHAIN, RESIDUAL, SLOW_NETWORK, _problem

GPUS, BATCH, PRICE = 4, 12, 50.0


def _unusable_ms(cost: CostModel, assignment: dict[str, int], piece_ms: float) -> float:
    """Idle rank-time of the ranks that run a layer that whole pieces cannot fill (a window's remainder)."""
    phases, iteration = cost.schedule(assignment), cost.iteration_ms(assignment)
    lost = 0.0
    for rank in range(max(assignment.values())):
        for window in rank_idle_windows(phases, rank, iteration):
            lost += window.length_ms - _fit(window.length_ms, piece_ms)
    return lost


def test_the_slots_follow_the_schedule_phase_by_phase():
    cost, _ = _problem(RESIDUAL, GPUS, BATCH, SLOW_NETWORK)
    assignment = dict(zip(RESIDUAL.names, (1, 4, 2, 3), strict=False)) | {name: 2 for name in RESIDUAL.names[4:]}
    rounds = cost.group_rounds_ms(assignment)  # a group's latency rounds ride on its first layer's all-reduce
    timed = [(slot.ranks(assignment), cost.slot_ms(slot, assignment)
              + (rounds.get(slot.layer, 0.0) if slot.kind is SlotKind.ALLREDUCE else 0.0))
             for slot in cost.slots()]
    phases = [p for p in cost.schedule(assignment) if p.layer]  # the optimizer's per-call phase is not a slot
    assert [(p.ranks, pytest.approx(p.end_ms - p.start_ms)) for p in phases] == [t for t in timed if t[1] > 0]


@pytest.mark.parametrize(("graph", "piece_ms"), [
    pytest.param(CHAIN, 3.0, id="chain-3"), pytest.param(CHAIN, 8.0, id="chain-8"),
    # the residual graph's 256 plans take 6 to 8 s each: in the heavy tier, the suite's time is spent
    pytest.param(RESIDUAL, 3.0, id="residual-3", marks=pytest.mark.heavy),
    pytest.param(RESIDUAL, 8.0, id="residual-8", marks=pytest.mark.heavy),
])
def test_cuts_never_price_more_than_the_idle_time_pieces_cannot_use(graph, piece_ms):
    """Cuts learnt from every assignment, applied to every assignment: the ILP's added GPU-time is at most the
    idle time of that plan's busy ranks that whole pieces leave over, so the search's bound stays a bound."""
    cost, _ = _problem(graph, GPUS, BATCH, SLOW_NETWORK)
    options = dict.fromkeys(graph.names, tuple(range(1, GPUS + 1)))
    windows = WindowCuts(cost=cost, options=options, gpus=GPUS, piece_ms=piece_ms)
    plans = [dict(zip(graph.names, counts, strict=True))
             for counts in itertools.product(range(1, GPUS + 1), repeat=len(graph.names))]
    cuts = [cut for plan in plans for cut in windows.of(plan)]
    assert cuts, "some window must be shorter than a piece"
    priced = 0
    for plan in plans:
        fixed = {name: (g,) for name, g in plan.items()}
        plain = Ilp(cost, fixed, memory_bytes=None, reshard_pairs=True).solve(price=PRICE, time_limit_s=30)
        ilp = Ilp(cost, fixed, memory_bytes=None, reshard_pairs=True)
        ilp.add_window_cuts(cuts)
        cut = ilp.solve(price=PRICE, time_limit_s=30)
        unusable = 1e3 * (cut.objective - plain.objective) / PRICE
        assert -1e-6 <= unusable <= _unusable_ms(cost, plan, piece_ms) + 1e-6, plan
        priced += unusable > 1e-6
    assert priced > 0, "the cuts must price some plan's short windows"
