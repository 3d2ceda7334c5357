"""Mixed precision: autocast forwards, reshards in the dtype a layer really outputs, fp16 loss scaling
whose skip decision every rank shares; each checked step by step against single-process autocast training."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from deeppool.errors import DeeppoolError
from deeppool.executor.config import CheckpointConfig, LossScaling, OptimizerConfig, RunConfig
from deeppool.executor.engine.comm import TorchComm
from deeppool.executor.engine.precision import AgreedScaler, grad_scaler, output_dtypes
from deeppool.executor.training.checkpoint import load_run
from deeppool.model.loading import load_model
from deeppool.model.trace import trace
from deeppool.plans import ModelSpec, Precision
from tests.executor.plans import Assign, cycle, make_plan, model_path
from tests.executor.test_executor_checkpoint import assert_same
from tests.executor.test_executor_exact import train_threads
from tests.executor.test_executor_processes import deeppool_run
from tests.executor.test_executor_training import loader, pairs
from tests.net import free_port

MARGIN = 4
"""Correct runs stay this far under the precision's default bound (figures: docs/executor.md)."""

CASES = [
    ("mlp", 6, 2, cycle(2)),  # data parallel
    ("mlp", 6, 3, cycle(3, 1, 2)),  # reshards between groups of 3, 1 and 2
    ("residual", 7, 2, cycle(2, 1)),  # synchronised BatchNorm in bf16/fp16
    ("tiny_gpt", 6, 2, cycle(2, 1, 2)),  # fp32 (LayerNorm, residual adds) and low-precision layers resharded
]


def checked(plan, precision: Precision, steps: int = 3, scaling: LossScaling | None = None):
    config = RunConfig(steps=steps, check=True, optimizer=OptimizerConfig(lr=0.1, momentum=0.9), bucket_mb=0.0005,
                       precision=precision, loss_scaling=scaling or LossScaling())
    results = train_threads(plan, config, data=pairs(loader(plan, steps)))
    assert results[0].summary is not None and results[0].summary.check is not None
    return results[0].summary.check, results


@pytest.mark.parametrize("precision", [Precision.BF16, Precision.FP16])
@pytest.mark.parametrize(("name", "batch", "gpus", "assign"), CASES, ids=[f"{c[0]}-{c[2]}ranks" for c in CASES])
def test_autocast_training_matches_single_process_autocast(name: str, batch: int, gpus: int, assign: Assign,
                                                           precision: Precision) -> None:
    check, results = checked(make_plan(name, global_batch=batch, gpus=gpus, assign=assign), precision)
    assert check.bound == precision.check_bound
    assert check.passed and check.max_relative_difference * MARGIN <= check.bound, check
    assert results[0].summary.precision == precision.value
    assert all(p.dtype == torch.float32 for r in results for p in r.params.values())  # master weights stay fp32


def test_autocast_is_not_fp32() -> None:
    plan = make_plan("mlp", global_batch=6, gpus=2, assign=cycle(2, 1))
    _, bf16 = checked(plan, Precision.BF16, steps=1)
    _, fp32 = checked(plan, Precision.FP32, steps=1)
    assert any(not torch.equal(bf16[0].params[n], fp32[0].params[n]) for n in fp32[0].params)


def test_an_fp16_overflow_skips_the_step_on_every_rank() -> None:
    plan = make_plan("mlp", global_batch=6, gpus=3, assign=cycle(3, 1, 2))
    overflow = LossScaling(initial=2.0**40, backoff=2.0**-30)  # step 0 overflows; 2^10 after it does not
    check, skipped = checked(plan, Precision.FP16, steps=1, scaling=overflow)
    initial = dict(load_model(plan.model).module.named_parameters())
    assert check.passed
    assert all(torch.equal(r.params[name], initial[name]) for r in skipped for name in r.params)
    check, trained = checked(plan, Precision.FP16, steps=3, scaling=overflow)
    assert check.passed and check.max_relative_difference * MARGIN <= check.bound, check  # torch's GradScaler agrees
    assert all(any(not torch.equal(r.params[n], initial[n]) for n in r.params) for r in trained)


def test_output_dtypes_are_what_autocast_gives() -> None:
    loaded = load_model(ModelSpec.parse(model_path("tiny_gpt")))
    traced = trace(loaded)
    before = {name: value.clone() for name, value in traced.module.state_dict().items()}
    dtypes = output_dtypes(traced.module, traced.graph, loaded.named_inputs(2), Precision.FP16, torch.device("cpu"))
    assert dtypes["tok_emb"] == torch.float32 and dtypes["blocks_0_ln_1"] == torch.float32
    assert dtypes["blocks_0_attn_q_proj"] == torch.float16 and dtypes["blocks_0_mlp_fc"] == torch.float16
    assert all(torch.equal(value, before[name]) for name, value in traced.module.state_dict().items())
    assert output_dtypes(traced.module, traced.graph, loaded.named_inputs(2), Precision.FP32, torch.device("cpu")) == {}


def _agree(rank: int, port: int, out: str) -> None:
    """Rank 0's gradient overflows, rank 1's does not; both must skip and back off alike."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        scaler = AgreedScaler(LossScaling(initial=8.0, interval=2), TorchComm([], timeout_s=30))
        history = []
        for step in range(3):
            grad = torch.tensor([8.0, float("inf") if rank == 0 and step == 0 else 4.0])
            history.append((scaler.unscale_and_agree([grad]), scaler.scale, grad.tolist()))
        Path(out, f"rank{rank}.json").write_text(json.dumps(history))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_every_rank_skips_when_one_rank_overflows(tmp_path: Path) -> None:
    mp.spawn(_agree, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    histories = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [[(skip, scale) for skip, scale, _ in h] for h in histories] == [[(True, 4.0), (False, 4.0), (False, 8.0)]] * 2
    assert histories[1][1][2] == [2.0, 1.0]  # unscaled by 1/4
    reference = grad_scaler(LossScaling(initial=8.0, interval=2), torch.device("cpu"))
    parameter = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    reference.scale(torch.ones(()))  # GradScaler makes its scale tensor here
    scales = []
    for step in range(3):
        parameter.grad = torch.tensor([8.0, float("inf") if step == 0 else 4.0])
        reference.step(optimizer)
        reference.update()
        scales.append(reference.get_scale())
    assert scales == [4.0, 4.0, 8.0]  # torch's GradScaler, one process


def test_loss_scaling_is_validated() -> None:
    with pytest.raises(DeeppoolError, match="--loss-scale"):
        LossScaling(initial=0.0)
    with pytest.raises(DeeppoolError, match="backoff"):
        LossScaling(backoff=1.5)


@pytest.mark.slow
@pytest.mark.parametrize(("precision", "name", "gpus", "assign", "extra"), [
    ("bf16", "mlp", 2, cycle(2), []),
    ("fp16", "tiny_gpt", 3, cycle(3, 1, 2), ["--accumulate", "2"]),
])
def test_the_command_line_trains_in_mixed_precision_and_passes_the_check(
        tmp_path: Path, capfd, precision: str, name: str, gpus: int, assign: Assign, extra: list[str]) -> None:
    plan_path = tmp_path / "plan.json"
    make_plan(name, global_batch=6, gpus=gpus, assign=assign).save(plan_path)
    proc, _ = deeppool_run(capfd, plan_path, "--nproc", str(gpus), "--steps", "3", "--check", "--lr", "0.1",
                           "--precision", precision, "--out", str(tmp_path / "out"), *extra)
    assert proc.code == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["precision"] == precision
    check = summary["check"]
    assert check["passed"] and check["max_relative_difference"] * MARGIN <= check["bound"], check
    assert os.path.isfile(tmp_path / "out" / "trace-rank0.json")


def test_a_resumed_fp16_run_keeps_its_loss_scale(tmp_path: Path) -> None:
    plan = make_plan("mlp", global_batch=6, gpus=3, assign=cycle(3, 1, 2))
    overflow = LossScaling(initial=2.0**40, backoff=2.0**-30)  # a fresh scale would skip step 2 of a resumed run

    def train(steps: int, checkpoint: CheckpointConfig | None):
        config = RunConfig(steps=steps, optimizer=OptimizerConfig(lr=0.1, momentum=0.9), bucket_mb=0.0005,
                           precision=Precision.FP16, loss_scaling=overflow, checkpoint=checkpoint)
        return train_threads(plan, config, data=pairs(loader(plan, 4)))

    whole = train(4, None)
    train(2, CheckpointConfig(directory=tmp_path, every=2))
    assert load_run(tmp_path, 2).scaler == {"scale": 2.0**10, "growth_tracker": 1}
    assert_same(train(4, CheckpointConfig(directory=tmp_path, every=2, resume=True)), whole)
