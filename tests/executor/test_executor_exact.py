"""Exactness in one process: ranks are threads over a fake communicator.

Every rank's parameters after training must equal single-process training on
the same global batches, whatever GPU count each layer gets (uneven splits
included). The multi-process versions are in test_executor_processes.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from deeppool.executor.api import RankResult, train_rank
from deeppool.executor.config import OptimizerConfig, RunConfig
from deeppool.executor.engine.comm import Lane
from deeppool.executor.engine.data import SyntheticBatches
from deeppool.executor.training.reference import compare, train_reference
from deeppool.model.loading import load_model
from deeppool.plans import Optimizer, Plan
from tests.executor.fakes import SerialBuilder, ThreadComm, ThreadWorld, run_threads
from tests.executor.plans import Assign, cycle, make_plan

STEPS = 3


def train_threads(plan: Plan, config: RunConfig, **kwargs: object) -> list[RankResult]:
    builder = SerialBuilder(plan.gpus)
    return run_threads(
        ThreadWorld(plan.gpus), lambda comm: train_rank(plan, comm=comm, config=config, builder=builder, **kwargs)
    )


def assert_exact(plan: Plan, results: list[RankResult], optimizer: OptimizerConfig) -> None:
    loaded = load_model(plan.model)
    reference = train_reference(loaded, SyntheticBatches(loaded, plan.global_batch), steps=STEPS, optimizer=optimizer)
    held = set()
    for result in results:
        comparison = compare(result.params, reference)
        assert comparison.relative <= 1e-5, (result.rank, comparison)
        assert comparison.relative_to_update <= 1e-3, (result.rank, comparison)
        held |= set(result.params)
    assert held == set(reference.final)  # every parameter is trained somewhere (rank 0 holds all)
    summary = results[0].summary
    assert summary is not None
    assert summary.losses == pytest.approx(reference.losses, rel=1e-5)


CASES = [
    ("mlp", 6, 2, cycle(2, 1)),
    ("mlp", 6, 4, cycle(4, 2, 1, 3)),
    ("residual", 7, 2, cycle(2)),
    ("residual", 7, 4, cycle(1, 4, 2, 3)),
    ("branching", 6, 4, cycle(2, 4, 3, 1)),
    ("branching", 5, 2, cycle(1, 2)),
    ("tiny_gpt", 6, 4, cycle(4, 3, 1, 2)),
    ("tiny_gpt", 3, 2, cycle(2, 2, 1)),
    # reshards of channels-last outputs (permute_1, depthwise, relu), both ways: they travel channels last
    ("channels_last", 6, 2, cycle(2, 1)),
    ("channels_last", 6, 4, cycle(1, 4, 2, 3)),
]


@pytest.mark.parametrize(("name", "batch", "gpus", "assign"), CASES, ids=[f"{c[0]}-B{c[1]}-{c[2]}ranks" for c in CASES])
def test_matches_single_process_training(name: str, batch: int, gpus: int, assign: Assign) -> None:
    plan = make_plan(name, global_batch=batch, gpus=gpus, assign=assign)
    optimizer = OptimizerConfig(lr=0.1, momentum=0.9)
    results = train_threads(plan, RunConfig(steps=STEPS, warmup=1, optimizer=optimizer, bucket_mb=0.0005))
    assert_exact(plan, results, optimizer)


def test_adam_and_per_layer_synchronous_all_reduce() -> None:
    # Adam turns round-off into full steps on parameters whose gradient is ~0 (a bias
    # right before BatchNorm, an attention key bias), so it is checked on the chain.
    plan = make_plan("mlp", global_batch=7, gpus=3, assign=cycle(3, 1, 2))
    optimizer = OptimizerConfig(kind=Optimizer.ADAM, lr=0.01)
    results = train_threads(plan, RunConfig(steps=STEPS, warmup=1, optimizer=optimizer, bucket_mb=0))
    assert_exact(plan, results, optimizer)
    assert all(stage.allreduce_measured is not None for stage in results[0].summary.stages)


def test_a_user_data_loader_gives_the_same_training() -> None:
    plan = make_plan("mlp", global_batch=6, gpus=2, assign=cycle(1, 2))
    loaded = load_model(plan.model)
    dataset = TensorDataset(loaded.inputs(6)[0], loaded.targets(6))
    loader = DataLoader(dataset, batch_size=6, shuffle=False)
    optimizer = OptimizerConfig(lr=0.1)
    results = train_threads(plan, RunConfig(steps=STEPS, optimizer=optimizer), data=loader)
    assert_exact(plan, results, optimizer)


def test_check_inside_the_ranks_reports_the_difference() -> None:
    plan = make_plan("branching", global_batch=6, gpus=3, assign=cycle(3, 1, 2))
    results = train_threads(plan, RunConfig(steps=2, check=True, optimizer=OptimizerConfig(lr=0.1)))
    check = results[0].summary.check
    assert check is not None and check.passed and check.max_relative_difference <= 1e-5, check
    assert check.worst is not None and check.worst.rank in range(3)


def test_rank_results_carry_timing_for_every_layer_it_runs() -> None:
    plan = make_plan("mlp", global_batch=6, gpus=2, assign=cycle(2, 1))
    results = train_threads(plan, RunConfig(steps=4, warmup=2))
    summary = results[0].summary
    assert summary.measured_steps == 2 and summary.iteration_measured_ms > 0
    assert all(stage.fwd_measured > 0 and stage.bwd_measured > 0 for stage in summary.stages)
    assert torch.tensor(summary.losses).isfinite().all()


def test_check_is_exact_step_by_step_on_a_chaotic_batch_norm_relu_net() -> None:
    # Regression (Inception example: 1.09 with free-running comparison). Deep conv-BN-ReLU
    # nets amplify round-off into different ReLU masks, so --check compares each step from
    # the reference's parameters; synchronised BatchNorm reproduces the forward bit for bit.
    plan = make_plan("deep_bn", global_batch=6, gpus=3, assign=cycle(3, 3, 2, 1))
    config = RunConfig(steps=4, check=True, optimizer=OptimizerConfig(lr=0.1, momentum=0.9))
    check = train_threads(plan, config)[0].summary.check
    assert check is not None and check.passed, check
    assert check.gradient <= 1e-5 and check.buffer <= 1e-6 and check.parameter <= 1e-6, check


class _SkewedComm(ThreadComm):
    """Sums of more than one rank come out 1% too large (a bug the check must catch)."""

    def all_reduce(self, tensor: torch.Tensor, ranks: tuple[int, ...], *, async_op: bool = False,
                   lane: Lane = Lane.GRADIENTS):
        done = super().all_reduce(tensor, ranks, async_op=async_op, lane=lane)
        tensor.mul_(1.01)
        return done


def test_the_step_by_step_check_still_catches_a_wrong_gradient() -> None:
    plan = make_plan("mlp", global_batch=6, gpus=2, assign=cycle(2, 1))
    builder = SerialBuilder(plan.gpus)
    world = ThreadWorld(plan.gpus)
    config = RunConfig(steps=2, check=True, optimizer=OptimizerConfig(lr=0.1))
    results = run_threads(world, lambda comm: train_rank(plan, comm=_SkewedComm(world, comm.rank), config=config,
                                                         builder=builder))
    check = results[0].summary.check
    assert check is not None and not check.passed
    assert check.gradient == pytest.approx(0.01, rel=1e-3), check
