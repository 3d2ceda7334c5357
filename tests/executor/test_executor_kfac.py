"""``deeppool run --optimizer kfac``: K-FAC on a burst plan equals one process's K-FAC.

Each layer's factors are summed over its group's ranks from their rows, its eigendecompositions computed on
one rank of the group (round-robin) and the preconditioned gradient sent to the group; so every rank's
parameters after 3 steps equal single-process training with the same K-FAC. In one process over threads
(a fake communicator), and over real gloo processes; ``--check`` in lockstep, fp16 loss scaling, gradient
accumulation and clipping; checkpoints carry the factors and resume bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deeppool.adaptation.kfac_options import KfacOptions
from deeppool.errors import DeeppoolError
from deeppool.executor.config import (
    Adaptation,
    CheckpointConfig,
    OptimizerConfig,
    RunConfig,
    Training,
    check_adaptation,
)
from deeppool.executor.engine.data import SyntheticBatches
from deeppool.executor.training.checkpoint import step_dir
from deeppool.executor.training.reference import compare, train_reference
from deeppool.model.loading import load_model
from deeppool.plans import Combine, Optimizer, Plan, Precision
from tests.executor.gloo import Job, train_gloo
from tests.executor.plans import cycle, make_plan
from tests.executor.test_executor_exact import STEPS, train_threads

KFAC = OptimizerConfig(kind=Optimizer.KFAC, lr=0.1, momentum=0.9,
                       kfac=KfacOptions(damping=0.01, inv_update_steps=2, kl_clip=0.01))
PLAN = make_plan("mlp", global_batch=7, gpus=4, assign=cycle(4, 2, 1, 3))


def _reference(plan: Plan, optimizer: OptimizerConfig):
    loaded = load_model(plan.model)
    return train_reference(loaded, SyntheticBatches(loaded, plan.global_batch), steps=STEPS, optimizer=optimizer)


def _assert_matches(plan: Plan, params_by_rank: list[dict[str, torch.Tensor]], optimizer: OptimizerConfig) -> None:
    reference = _reference(plan, optimizer)
    for rank, params in enumerate(params_by_rank):
        comparison = compare(params, reference)
        # fp32 round-off of the factors' sums, amplified by up to 1/damping through the inverses
        assert comparison.relative <= 1e-4, (rank, comparison)
        assert comparison.relative_to_update <= 1e-3, (rank, comparison)
    plain = _reference(plan, OptimizerConfig(lr=optimizer.lr, momentum=optimizer.momentum))
    assert compare(params_by_rank[0], plain).relative_to_update > 0.1  # K-FAC's steps are not SGD's


def test_kfac_on_a_burst_plan_equals_one_process() -> None:
    assert len({layer.gpus for layer in PLAN.layers}) == 4
    results = train_threads(PLAN, RunConfig(steps=STEPS, warmup=1, optimizer=KFAC, bucket_mb=0.0005))
    _assert_matches(PLAN, [result.params for result in results], KFAC)


@pytest.mark.heavy  # 25 s on 2 cores (4 spawned ranks); the same plan over threads is in the default run
def test_kfac_over_gloo_processes_equals_one_process() -> None:
    (outcomes,) = train_gloo([Job(plan=PLAN, config=RunConfig(steps=STEPS, warmup=1, optimizer=KFAC))])
    _assert_matches(PLAN, [{n: torch.from_numpy(v) for n, v in o.params.items()} for o in outcomes], KFAC)


@pytest.mark.parametrize("precision", [Precision.FP32, Precision.FP16])
def test_check_in_lockstep_with_accumulation_and_clipping(precision: Precision) -> None:
    config = RunConfig(steps=STEPS, warmup=1, optimizer=KFAC, bucket_mb=0.0005, check=True, precision=precision,
                       training=Training(accumulate=2, clip_norm=0.5))
    results = train_threads(PLAN, config)
    for result in results:
        assert result.check is not None and result.check.passed, result.check


def test_checkpoints_carry_the_factors_and_resume_bit_identically(tmp_path: Path) -> None:
    plan = make_plan("mlp", global_batch=6, gpus=2, assign=cycle(2, 1))
    options = OptimizerConfig(kind=Optimizer.KFAC, lr=0.1, momentum=0.9,
                              kfac=KfacOptions(factor_update_steps=2, inv_update_steps=3))

    def train(steps: int, checkpoint: CheckpointConfig | None) -> list[dict[str, torch.Tensor]]:
        config = RunConfig(steps=steps, warmup=1, optimizer=options, bucket_mb=0.0005, checkpoint=checkpoint)
        return [result.params for result in train_threads(plan, config)]

    whole = train(5, None)
    train(2, CheckpointConfig(directory=tmp_path, every=2))
    saved = torch.load(step_dir(tmp_path, 2) / "kfac1.pt")
    assert saved["steps"] == 2 and saved["layers"]  # rank 1's factors (and the eigendecompositions it owns)
    resumed = train(5, CheckpointConfig(directory=tmp_path, resume=True))
    for mine, theirs in zip(resumed, whole, strict=True):
        assert all(torch.equal(mine[name], theirs[name]) for name in theirs), "resumed K-FAC run differs"


def test_adasum_is_refused_in_one_line() -> None:
    config = RunConfig(optimizer=KFAC, adaptation=Adaptation(combine=Combine.ADASUM))
    with pytest.raises(DeeppoolError, match="--optimizer kfac preconditions the mean gradient"):
        check_adaptation(PLAN, config, grouped=True)
