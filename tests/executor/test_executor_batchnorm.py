"""``--batchnorm local``: each rank normalises its own samples, as DDP with ``nn.BatchNorm`` does.

The matching reference is single-process training in which BatchNorm takes its statistics per rank's
slice of the batch: the model runs on each slice with the shared parameters and that rank's own
running buffers, and the loss is the slices' losses weighted by their share of the batch.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.func import functional_call

from deeppool.executor.api import RankResult, train_rank
from deeppool.executor.config import BatchNormMode, CheckpointConfig, OptimizerConfig, RunConfig
from deeppool.executor.training.checkpoint import export, step_dir
from deeppool.model.loading import LoadedModel, load_model
from deeppool.model.syncbn import GroupBatchNorm
from deeppool.plans import Plan
from tests.entry import deeppool
from tests.executor.fakes import SerialBuilder, ThreadWorld, run_threads
from tests.executor.plans import cycle, make_plan
from tests.executor.test_executor_checkpoint import assert_same

STEPS, LR = 2, 0.05


@dataclass(frozen=True)
class SliceReference:
    params: dict[str, torch.Tensor]
    """After ``STEPS`` optimizer steps."""
    buffers: list[dict[str, torch.Tensor]]
    """Each rank's running statistics, from its own slices."""
    losses: list[float]
    """The mean loss over the global batch, per step."""


def _slice_reference(plan: Plan) -> SliceReference:
    """Single-process training with BatchNorm statistics per rank's slice (``STEPS`` SGD steps)."""
    loaded: LoadedModel = load_model(plan.model)
    model = loaded.module.train()
    params = dict(model.named_parameters())
    slices = plan.layers[0].samples
    buffers = [{name: b.clone() for name, b in model.named_buffers()} for _ in slices]
    optimizer = torch.optim.SGD(params.values(), lr=LR)
    x, y, batch = loaded.inputs(plan.global_batch)[0], loaded.targets(plan.global_batch), plan.global_batch
    losses = []
    for _ in range(STEPS):
        total = sum(
            loaded.loss(functional_call(model, {**params, **buffers[r]}, (x[a:b],)), y[a:b]) * (b - a) / batch
            for r, (a, b) in enumerate(slices)
        )
        total.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(total.detach()))
    return SliceReference({name: p.detach() for name, p in params.items()}, buffers, losses)


def _train(plan: Plan, batchnorm: BatchNormMode, steps: int = STEPS,
           checkpoint: CheckpointConfig | None = None) -> list[RankResult]:
    config = RunConfig(steps=steps, optimizer=OptimizerConfig(lr=LR), batchnorm=batchnorm,
                       checkpoint=checkpoint)
    builder = SerialBuilder(plan.gpus)
    return run_threads(ThreadWorld(plan.gpus),
                       lambda comm: train_rank(plan, comm=comm, config=config, builder=builder))


def test_local_batch_norm_is_per_rank_statistics_training() -> None:
    plan = make_plan("deep_bn", global_batch=7, gpus=2, assign=cycle(2))  # data parallel, slices of 4 and 3
    reference = _slice_reference(plan)
    params, buffers = reference.params, reference.buffers
    results = _train(plan, BatchNormMode.LOCAL)
    for result in results:
        for name, value in result.params.items():
            torch.testing.assert_close(value, params[name], rtol=1e-4, atol=1e-5, msg=f"rank {result.rank} {name}")
        assert any("running_var" in name for name in result.buffers)
        for name, value in result.buffers.items():
            torch.testing.assert_close(value, buffers[result.rank][name], msg=f"rank {result.rank} {name}")
    mean = "stem.bn.running_mean"  # the ranks' statistics differ, so synchronised ones would not match
    assert not torch.allclose(buffers[0][mean], buffers[1][mean])


def test_local_batch_norm_resumes_each_ranks_own_statistics(tmp_path: Path) -> None:
    plan = make_plan("deep_bn", global_batch=7, gpus=2, assign=cycle(2))
    whole = _train(plan, BatchNormMode.LOCAL, steps=4)
    _train(plan, BatchNormMode.LOCAL, steps=2, checkpoint=CheckpointConfig(directory=tmp_path, every=2))
    resumed = _train(plan, BatchNormMode.LOCAL, steps=4,
                     checkpoint=CheckpointConfig(directory=tmp_path, every=2, resume=True))
    assert_same(resumed, whole)
    _, state = export(tmp_path, 2)
    mean = "stem.bn.running_mean"
    assert torch.equal(state[mean], torch.load(step_dir(tmp_path, 2) / "rank0.pt")[mean]), "rank 0's, as DDP"


@pytest.mark.slow
@pytest.mark.heavy  # the in-process tests above train and resume the same statistics
def test_run_with_local_batch_norm_trains_per_rank_statistics_in_processes(tmp_path: Path, capfd) -> None:
    plan = make_plan("deep_bn", global_batch=7, gpus=2, assign=cycle(2))
    plan.save(tmp_path / "plan.json")
    out = tmp_path / "out"
    common = ("--steps", str(STEPS), "--warmup", "1", "--optimizer", "sgd", "--lr", str(LR), "--out", str(out))
    refused = deeppool(capfd, "run", str(tmp_path / "plan.json"), "--batchnorm", "local", "--check", *common)
    assert refused.code == 2
    assert refused.stderr.strip() == (
        "error: --check compares with single-process training, whose BatchNorm uses the whole batch's "
        "statistics: run --check with --batchnorm sync")
    done = deeppool(capfd, "run", str(tmp_path / "plan.json"), "--batchnorm", "local", *common)
    assert done.code == 0, done.stderr[-3000:]
    losses = json.loads((out / "summary.json").read_text())["losses"]
    assert losses == pytest.approx(_slice_reference(plan).losses, rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_synchronised_batch_norm_takes_reduced_precision_activations(dtype: torch.dtype) -> None:
    # as under autocast: bf16/fp16 activations, fp32 parameters (PyTorch's fused kernel refuses the mix)
    torch.manual_seed(0)
    bn = torch.nn.BatchNorm2d(4)
    reference = copy.deepcopy(bn)
    x = (torch.randn(6, 4, 5, 5) * 3 + 1).to(dtype)
    grad = torch.randn(6, 4, 5, 5).to(dtype)
    mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    GroupBatchNorm(bn, lambda t: None)(mine).backward(grad)
    reference(theirs).backward(grad)
    assert mine.grad is not None and mine.grad.dtype == dtype and bn.weight.grad is not None
    torch.testing.assert_close(mine.grad.float(), theirs.grad.float(), rtol=0.05, atol=0.02)
    torch.testing.assert_close(bn.weight.grad, reference.weight.grad, rtol=0.01, atol=0.1)
    torch.testing.assert_close(bn.bias.grad, reference.bias.grad, rtol=0.01, atol=0.1)
