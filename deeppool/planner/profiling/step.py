"""What an optimizer's step costs beyond its memory traffic: per call and per parameter tensor on tiny tensors
(:func:`measure_step_overhead`), and per megabyte of the model's own parameters right after a backward
(:func:`measure_model_step`)."""

from __future__ import annotations

import statistics
from dataclasses import replace

import torch

from deeppool.plans import Optimizer
from deeppool.planner.profiling.passes import Passes
from deeppool.planner.profiling.profile import StepOverhead
from deeppool.planner.profiling.timing import timed


STEP_REPEATS, STEP_WARMUP = 5, 1
"""The timed and untimed steps per optimizer of :func:`measure_model_step`, each after a whole pass."""


STEP_BUDGET_MS = 1500.0
"""What :func:`measure_model_step`'s passes may take at the batch chosen for them
(:meth:`~deeppool.planner.profiling.profiler.LayerProfiler._step_batch`)."""


def measure_step_overhead(device: torch.device, repeats: int = 15, tensors: int = 33) -> dict[str, StepOverhead]:
    """Each optimizer's step beyond its memory traffic: ``step()`` then ``zero_grad(set_to_none=True)``
    (as the executor steps) over 1 and over ``tensors`` tiny parameters, the median of ``repeats``;
    the difference per extra tensor is the per-tensor cost, the rest the per-call cost."""
    found = {}
    for optimizer in Optimizer.first_order():
        one, many = (_step_ms(optimizer, device, count, repeats) for count in (1, tensors))
        per_tensor = max(0.0, (many - one) / (tensors - 1))
        found[optimizer.value] = StepOverhead(call_ms=max(0.0, one - per_tensor), per_tensor_ms=per_tensor)
    return found


def _step_ms(optimizer: Optimizer, device: torch.device, count: int, repeats: int) -> float:
    params = [torch.nn.Parameter(torch.zeros(16, device=device)) for _ in range(count)]
    step = _optimizer(optimizer, params, lr=1e-3)

    def once() -> float:
        for param in params:
            param.grad = torch.zeros_like(param)
        return timed(device, lambda: (step.step(), step.zero_grad(set_to_none=True)))[0]

    for _ in range(3):
        once()
    return statistics.median(once() for _ in range(repeats))


def _optimizer(optimizer: Optimizer, params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """The executor's optimizer of this kind (SGD without momentum, Adam) over ``params``."""
    return torch.optim.Adam(params, lr=lr) if optimizer is Optimizer.ADAM else torch.optim.SGD(params, lr=lr)


def measure_model_step(passes: Passes, inputs: dict[str, torch.Tensor], batch: int,
                       overhead: dict[str, StepOverhead], bandwidth: float, repeats: int = STEP_REPEATS,
                       warmup: int = STEP_WARMUP) -> dict[str, StepOverhead]:
    """``overhead`` with each optimizer's ``per_megabyte_ms``: its ``step()`` and ``zero_grad(set_to_none=True)``
    over the model's own parameters right after a whole pass's backward (as a one-stage executor steps), the
    median of ``repeats``, beyond what the tiny tensors' overhead and the memory traffic at ``bandwidth`` price,
    per megabyte of parameters: after a backward the parameters are out of the caches and the gradients it
    allocated are freed, which a step on tiny warm tensors does not see (``docs/planner.md``, ``OPT_l``;
    ``docs/notes/0009-optimizer-step-after-backward.md``). The steps run at learning rate 0: the weights stay
    as they are."""
    params = [param for param in passes.module.parameters() if param.requires_grad]
    found = dict(overhead)
    for optimizer in Optimizer.first_order():
        step = _optimizer(optimizer, params, lr=0.0)
        times, stepped = [], []
        for index in range(warmup + repeats):
            passes.whole(inputs, batch=batch)
            stepped = [param for param in params if param.grad is not None]
            ms = timed(passes.device, lambda s=step: (s.step(), s.zero_grad(set_to_none=True)))[0]
            if index >= warmup:
                times.append(ms)
        megabytes = sum(param.numel() * param.element_size() for param in stepped) / 1e6
        if megabytes <= 0:
            continue
        base = overhead.get(optimizer.value, StepOverhead())
        streamed = 1e3 * optimizer.step_traffic(megabytes * 1e6) / bandwidth
        beyond = statistics.median(times) - base.call_ms - base.per_tensor_ms * len(stepped) - streamed
        found[optimizer.value] = replace(base, per_megabyte_ms=max(0.0, beyond / megabytes))
    return found
