"""``--check`` catches real executor bugs and names the tensor at fault.

Each bug is injected into the executor (ranks are threads in this process, so
patching a class patches every rank); the check must fail, and its worst
tensor must be the one the bug touched. Correct runs must pass by a wide margin.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from deeppool.executor.config import OptimizerConfig, RunConfig
from deeppool.executor.engine.engine import Engine, _State
from deeppool.executor.engine.program import Op
from deeppool.executor.training.reference import CheckResult, Difference, Kind, worst_of
from deeppool.model.syncbn import GroupBatchNorm
from deeppool.plans import Plan
from tests.executor.plans import Assign, cycle, make_plan
from tests.executor.test_executor_exact import train_threads

MARGIN = 10.0
"""Correct runs must stay this far under the default bound."""

Handler = Callable[[Engine, Op, _State], None]
Reduce = Callable[[Engine, str, tuple[int, ...]], None]


def check_of(plan: Plan, steps: int = 2) -> CheckResult:
    config = RunConfig(steps=steps, check=True, optimizer=OptimizerConfig(lr=0.1, momentum=0.9), bucket_mb=0.0005)
    check = train_threads(plan, config)[0].summary.check
    assert check is not None
    return check


def patch_allreduce(monkeypatch: pytest.MonkeyPatch, layer: str, change: Callable[[Engine], None]) -> None:
    """Apply ``change`` to the rank's gradients just before ``layer``'s gradient all-reduce."""
    original: Reduce = Engine._reduce_layer

    def reduce_layer(engine: Engine, name: str, ranks: tuple[int, ...]) -> None:
        if name == layer:
            change(engine)
        original(engine, name, ranks)

    monkeypatch.setattr(Engine, "_reduce_layer", reduce_layer)


def scale_gradients(names: tuple[str, ...], factor: float) -> Callable[[Engine], None]:
    def change(engine: Engine) -> None:
        for name in names:
            grad = engine.parts.model.params[name].grad
            assert grad is not None
            grad.mul_(factor)

    return change


def caught(check: CheckResult, kind: Kind, names: set[str]) -> Difference:
    assert not check.passed, check
    worst = check.worst
    assert worst is not None and worst.kind is kind and worst.name in names, check
    assert worst.value > 10 * check.bound
    return worst


CORRECT = [
    ("mlp", 6, 2, cycle(2, 1)),
    ("residual", 7, 4, cycle(1, 4, 2, 3)),
    ("branching", 6, 3, cycle(3, 1, 2)),
    ("tiny_gpt", 6, 4, cycle(4, 3, 1, 2)),
    ("deep_bn", 6, 3, cycle(3, 3, 2, 1)),
]


@pytest.mark.parametrize(("name", "batch", "gpus", "assign"), CORRECT, ids=[c[0] for c in CORRECT])
def test_correct_runs_pass_with_a_wide_margin(name: str, batch: int, gpus: int, assign: Assign) -> None:
    check = check_of(make_plan(name, global_batch=batch, gpus=gpus, assign=assign), steps=3)
    assert check.passed and check.max_relative_difference * MARGIN <= check.bound, check
    assert check.worst is not None


def test_a_skipped_gradient_all_reduce_names_the_embedding(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = make_plan("tiny_gpt", global_batch=6, gpus=2, assign=cycle(2, 1))
    original: Reduce = Engine._reduce_layer

    def reduce_layer(engine: Engine, name: str, ranks: tuple[int, ...]) -> None:
        if name != "tok_emb":
            original(engine, name, ranks)

    monkeypatch.setattr(Engine, "_reduce_layer", reduce_layer)
    caught(check_of(plan), Kind.GRADIENT, {"tok_emb.weight"})


def test_a_zeroed_layer_norm_gradient_names_the_layer_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = make_plan("tiny_gpt", global_batch=6, gpus=2, assign=cycle(2, 1))
    names = ("blocks.0.ln_1.weight", "blocks.0.ln_1.bias")
    patch_allreduce(monkeypatch, "blocks_0_ln_1", scale_gradients(names, 0.0))
    assert caught(check_of(plan), Kind.GRADIENT, set(names)).value == pytest.approx(1.0)


def test_a_scaled_batch_norm_gradient_names_the_batch_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = make_plan("residual", global_batch=6, gpus=2, assign=cycle(2, 1))
    names = ("blocks.0.bn1.weight", "blocks.0.bn1.bias")
    patch_allreduce(monkeypatch, "blocks_0_bn1", scale_gradients(names, 0.9))
    assert caught(check_of(plan), Kind.GRADIENT, set(names)).value == pytest.approx(0.1, rel=1e-3)


def test_frozen_running_statistics_name_the_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = make_plan("residual", global_batch=6, gpus=2, assign=cycle(2, 1))  # blocks_0_bn1 on 2 ranks
    monkeypatch.setattr(GroupBatchNorm, "_update_running", staticmethod(lambda *args: None))
    worst = caught(check_of(plan), Kind.BUFFER, {"blocks.0.bn1.running_mean", "blocks.0.bn1.num_batches_tracked"})
    assert worst.name == "blocks.0.bn1.running_mean" and worst.step == 0


def test_a_dropped_reshard_row_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = make_plan("mlp", global_batch=6, gpus=2, assign=cycle(2, 1))  # '_0' on 2 ranks feeds '_1' on 1
    original: Handler = Engine._reshard

    def reshard(engine: Engine, op: Op, state: _State) -> None:
        original(engine, op, state)
        received = [t for t in op.transfers if t.dst == engine.rank and t.src != engine.rank]
        if (op.layer, op.producer) == ("_1", "_0") and received:
            row = received[0].start - engine.planned[op.layer].samples[engine.rank][0]
            with torch.no_grad():
                state.leaves[(op.stage, op.producer)][row].zero_()

    monkeypatch.setattr(Engine, "_reshard", reshard)
    caught(check_of(plan), Kind.GRADIENT, {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"})


def test_a_check_result_round_trips_through_json_and_names_its_worst_tensor() -> None:
    worst = Difference(kind=Kind.GRADIENT, name="blocks.0.ln1.weight", value=0.31, step=0, rank=1)
    check = CheckResult(gradient=0.31, buffer=1e-7, parameter=2e-7, worst=worst, bound=1e-3)
    assert CheckResult.from_json(check.to_json()) == check
    assert check.line() == "max relative difference: 3.100e-01 (gradient of 'blocks.0.ln1.weight', step 0, rank 1)"
    assert not check.passed and check.to_json()["passed"] is False
    buffer = Difference(kind=Kind.BUFFER, name="bn.running_mean", value=0.5, step=2, rank=0)
    other = CheckResult(gradient=1e-6, buffer=0.5, parameter=0.0, worst=buffer, bound=1e-3)
    merged = worst_of([check, other])
    assert merged == CheckResult(gradient=0.31, buffer=0.5, parameter=2e-7, worst=buffer, bound=1e-3)
