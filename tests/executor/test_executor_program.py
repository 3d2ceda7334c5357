"""The per-rank program: sample moves, gradient flow, op order, idle-window positions."""

import pytest

from deeppool.errors import DeeppoolError
from deeppool.executor.engine.program import OpKind, Transfer, build_program, idle_positions, transfers
from deeppool.model.graph import grad_flows
from deeppool.model.loading import load_model
from deeppool.model.trace import trace
from deeppool.plans import IdleWindow, sample_ranges
from tests.executor.plans import cycle, make_plan


def test_transfers_cover_every_sample_once_for_uneven_splits() -> None:
    moves = transfers(sample_ranges(6, 4), sample_ranges(6, 3))
    assert moves == (
        Transfer(src=0, dst=0, start=0, end=1), Transfer(src=1, dst=0, start=1, end=2),
        Transfer(src=1, dst=1, start=2, end=3), Transfer(src=2, dst=1, start=3, end=4),
        Transfer(src=3, dst=2, start=4, end=6),
    )
    for src, dst in [((6, 1), (6, 4)), ((7, 4), (7, 3)), ((5, 2), (5, 2))]:
        covered = sorted((m.start, m.end) for m in transfers(sample_ranges(*src), sample_ranges(*dst)))
        assert sum(end - start for start, end in covered) == src[0]


def test_same_split_stays_local() -> None:
    assert all(m.src == m.dst for m in transfers(sample_ranges(7, 3), sample_ranges(7, 3)))


def test_program_follows_the_schedule_and_skips_layers_a_rank_does_not_run() -> None:
    plan = make_plan("mlp", global_batch=6, gpus=4, assign=cycle(4, 2, 1, 3))
    graph = trace(load_model(plan.model)).graph
    kinds = [(op.kind, op.layer) for op in build_program(plan, graph, 0).ops]
    assert kinds[:3] == [(OpKind.FORWARD, "_0"), (OpKind.RESHARD, "_1"), (OpKind.FORWARD, "_1")]
    assert (OpKind.LOSS, "_4") in kinds and kinds[-1] == (OpKind.STEP, graph.layers[-1].name)
    rank3 = [(op.kind, op.layer) for op in build_program(plan, graph, 3).ops]
    assert (OpKind.FORWARD, "_1") not in rank3 and (OpKind.FORWARD, "_2") not in rank3
    assert (OpKind.RESHARD, "_1") in rank3  # rank 3 sends its samples of _0 to _1's ranks


def test_gradient_flow_stops_at_integer_outputs() -> None:
    plan = make_plan("tiny_gpt", global_batch=4, gpus=2, assign=cycle(2))
    graph = trace(load_model(plan.model)).graph
    flows = grad_flows(graph)
    assert flows[graph.output]
    assert all(flows[layer.name] is False for layer in graph.layers if layer.dtype in ("int64", "bool"))


@pytest.mark.parametrize("rank", range(4))
def test_idle_windows_are_tied_to_the_phase_they_follow(rank: int) -> None:
    plan = make_plan("residual", global_batch=7, gpus=4, assign=cycle(1, 4, 2, 3))
    program = build_program(plan, trace(load_model(plan.model)).graph, rank)
    positions = idle_positions(program, plan.idle_windows(rank))
    assert len(positions) == len(plan.idle_windows(rank))
    assert (len(positions) > 0) == (rank > 0)  # rank 0 runs every layer
    for position, window in positions.items():
        label = None if position is None else program.phases[position].label
        assert label == window.after


def test_idle_windows_that_do_not_follow_from_the_plan_are_refused() -> None:
    plan = make_plan("mlp", global_batch=6, gpus=2, assign=cycle(2, 1))
    program = build_program(plan, trace(load_model(plan.model)).graph, 1)
    bogus = [IdleWindow(rank=1, start_ms=0.0, end_ms=1.0, after="forward:nowhere")]
    with pytest.raises(DeeppoolError, match="idle windows"):
        idle_positions(program, bogus)
