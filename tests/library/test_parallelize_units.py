"""``deeppool.parallelize`` in this process (a world of one rank): what it refuses in one line, what it leaves
alone, and what it gives back."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import deeppool
from deeppool.errors import DeeppoolError
from deeppool.plans import ModelSource
from tests.executor.plans import cycle, make_plan_for
from tests.library.test_parallelize import CNN
from tests.library.user_loop import model_file

BATCH = 4


@pytest.fixture(scope="module")
def world() -> Iterator[None]:
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def plan(world):
    return make_plan_for(CNN, global_batch=BATCH, gpus=1, assign=cycle(1))


def test_the_user_module_is_left_alone_and_the_state_dict_loads_into_it(plan) -> None:
    cnn = model_file(CNN)
    module = cnn.model()
    before = {key: value.clone() for key, value in module.state_dict().items()}
    bp = deeppool.parallelize(module, plan)
    opt = torch.optim.SGD(bp.parameters(), lr=0.1)
    (x,), y = cnn.inputs(BATCH), cnn.targets(BATCH)
    loss = bp.step(x, y, cnn.loss)
    assert loss.dim() == 0 and torch.isfinite(loss)
    opt.step()
    for key, value in module.state_dict().items():
        torch.testing.assert_close(value, before[key])  # parallelize trained a copy
    state = bp.state_dict()
    assert list(state) == list(module.state_dict())
    module.load_state_dict(state)
    assert [name for name, _ in bp.named_parameters()] == [name for name, _ in module.named_parameters()]
    assert bp.rank_rows(BATCH) == list(range(BATCH)) and bp.is_logging_rank
    assert bp.last_step_s is not None and bp.last_step_s > 0
    bp.eval()
    module.eval()
    with torch.no_grad():
        torch.testing.assert_close(bp.eval_step(x), module(x))


@pytest.mark.parametrize(("call", "message"), [
    (lambda bp, x, y: bp.step(x[:3], y[:3]), "the batch has 3 rows: give the plan's global batch of 4"),
    (lambda bp, x, y: bp.rank_rows(8), "the plan's global batch is 4 samples, not 8"),
    (lambda bp, x, y: bp.load_state_dict({}), "the state dict lacks"),
])
def test_mistakes_are_one_line(plan, call, message: str) -> None:
    cnn = model_file(CNN)
    bp = deeppool.parallelize(cnn.model(), plan)
    (x,), y = cnn.inputs(BATCH), cnn.targets(BATCH)
    with pytest.raises(DeeppoolError, match=message) as raised:
        call(bp, x, y)
    assert "\n" not in str(raised.value)


def test_a_plan_for_other_gpus_or_from_python_is_refused(plan) -> None:
    cnn = model_file(CNN)
    with pytest.raises(DeeppoolError, match="the plan is for 2 GPUs but 1 ranks were started"):
        deeppool.parallelize(cnn.model(), dataclasses.replace(plan, gpus=2))
    python = dataclasses.replace(plan, model=dataclasses.replace(plan.model, source=ModelSource.PYTHON))
    with pytest.raises(DeeppoolError, match="give parallelize\\(..., example_inputs=...\\)"):
        deeppool.parallelize(cnn.model(), python)
    (x,) = cnn.inputs(2)
    bp = deeppool.parallelize(cnn.model(), python, example_inputs=x)  # traced with the rows given
    assert bp.rank_rows(BATCH) == list(range(BATCH))


def test_another_model_is_refused(plan) -> None:
    with pytest.raises(DeeppoolError, match="plan does not match model"):
        deeppool.parallelize(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten()), plan)


def test_forward_gives_the_output_and_the_loss_backward_the_plans_gradients(plan) -> None:
    cnn = model_file(CNN)
    module = cnn.model()
    bp = deeppool.parallelize(module, plan)
    (x,), y = cnn.inputs(BATCH), cnn.targets(BATCH)
    output = bp.forward(x)
    assert output.requires_grad
    cnn.loss(output, y).backward()  # the user's own loss and backward
    through_forward = {name: param.grad.clone() for name, param in bp.named_parameters()}
    cnn.loss(module(x), y).backward()
    for name, param in module.named_parameters():
        torch.testing.assert_close(through_forward[name], param.grad, msg=name)
    for param in bp.parameters():
        param.grad = None
    bp.step(x, y, cnn.loss)
    for name, param in bp.named_parameters():
        torch.testing.assert_close(param.grad, through_forward[name], msg=name)
    with torch.no_grad():
        assert not bp.forward(x).requires_grad  # without gradients: eval_step


TWO_HEADS = """import torch
from torch import nn


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.left, self.right = nn.Linear(8, 2), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return {"left": self.left(h), "right": self.right(h)}


def model():
    return TwoHeads()


def inputs(batch_size):
    return (torch.randn(batch_size, 4),)
"""


def test_forward_refuses_an_output_that_is_not_one_tensor(world, tmp_path) -> None:
    path = tmp_path / "two_heads.py"
    path.write_text(TWO_HEADS)
    plan = make_plan_for(path, global_batch=BATCH, gpus=1, assign=cycle(1))
    bp = deeppool.parallelize(model_file(str(path)).model(), plan)
    with pytest.raises(DeeppoolError, match="the model's output is a dict, not one tensor: bp.forward needs"):
        bp.forward(torch.randn(BATCH, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(DeeppoolError, match="runs in 32-bit"):
        bp.forward(torch.randn(BATCH, 4))
