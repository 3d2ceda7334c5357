"""What is refused before any rank starts: each a one-line :class:`DeeppoolError` (exit 2).

* a plan with no idle windows (nothing to lend);
* a mode this machine cannot provide (``priority`` and ``mps`` need CUDA,
  ``mps`` also ``nvidia-cuda-mps-control``);
* a background model file that does not load;
* a background job that does not fit: the plan's peak memory plus the
  background's (parameters, gradients, optimizer state, activations of one
  batch, measured by a forward pass on the meta device) must fit the device.

With ``preflight_apart`` (the coordinator's guests), the background model is
loaded for this in a process of its own (``python -m
deeppool.multiplex.preflight``), never in the foreground's: the background's
code runs only in the background's processes. ``deeppool run --background``
loads it here (one user's own jobs; a process costs a Python and torch
start-up).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from deeppool.device.cuda import CudaGpu
from deeppool.device.mps import control_available
from deeppool.device.seam import Gpu
from deeppool.errors import DeeppoolError
from deeppool.executor.config import OptimizerConfig
from deeppool.model.loading import load_model
from deeppool.multiplex.config import BackgroundConfig, MuxMode
from deeppool.multiplex.job import forward
from deeppool.plans import ModelSpec, Optimizer, Plan

GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class Machine:
    """What this machine offers (injected so tests can pretend)."""

    cuda: bool
    mps_control: bool
    device_bytes: int

    @classmethod
    def here(cls, *, gpu: bool, device: Gpu | None = None) -> Machine:
        """``device``: the seam (the real GPU when not given)."""
        device = device or CudaGpu()
        cuda = device.available()
        if gpu and cuda:
            total = device.total_memory(device.current())
        else:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return cls(cuda=cuda, mps_control=control_available(), device_bytes=total)


@dataclass(frozen=True, kw_only=True)
class BackgroundMemory:
    params: int
    gradients: int
    optimizer_state: int
    activations: int

    @property
    def total(self) -> int:
        return self.params + self.gradients + self.optimizer_state + self.activations


def check(plan: Plan, config: BackgroundConfig, machine: Machine | None = None) -> BackgroundMemory:
    """Refuse what cannot run; returns the background's memory estimate."""
    check_windows(plan)
    machine = machine or Machine.here(gpu=config.mode.needs_gpu)
    check_mode(config.mode, machine)
    if config.broker is not None:  # a guest of another account: measured by a process of its own account's
        from deeppool.multiplex.remote import measured

        memory = BackgroundMemory(**measured(config.broker))
    else:
        measure = measured_apart if config.preflight_apart else background_memory
        memory = measure(config.model, config.batch, config.optimizer)  # a one-line error if it does not load
    check_memory(plan, memory, machine, config)
    return memory


def check_windows(plan: Plan) -> None:
    if not any(w.length_ms > 0 for w in plan.predicted.idle_windows):
        raise DeeppoolError(
            f"the plan has no idle windows: every layer runs on all {plan.gpus} GPUs, so no rank is ever idle and "
            "there is nothing to lend to --background; re-plan with fewer GPUs for some layers, or drop --background"
        )


def check_mode(mode: MuxMode, machine: Machine) -> None:
    if mode.needs_gpu and not machine.cuda:
        raise DeeppoolError(f"--mux {mode.value} needs a CUDA GPU and none is visible here: "
                            "use --mux gate (or sched_idle, none) on CPU")
    if mode is MuxMode.MPS and not machine.mps_control:
        raise DeeppoolError("--mux mps needs nvidia-cuda-mps-control on PATH: install the CUDA MPS tools "
                            "or use --mux priority")


def check_memory(plan: Plan, memory: BackgroundMemory, machine: Machine, config: BackgroundConfig) -> None:
    peak = plan.predicted.peak_memory_bytes
    left = machine.device_bytes - peak
    if memory.total > left:
        raise DeeppoolError(
            f"background model '{config.model.name}' at --bg-batch {config.batch} needs "
            f"{memory.total / GIB:.2f} GiB (parameters {memory.params / GIB:.2f}, gradients "
            f"{memory.gradients / GIB:.2f}, optimizer {memory.optimizer_state / GIB:.2f}, activations "
            f"{memory.activations / GIB:.2f}) but the device has {machine.device_bytes / GIB:.2f} GiB and the plan's "
            f"peak is {peak / GIB:.2f} GiB, leaving {max(left, 0) / GIB:.2f} GiB: use a smaller --bg-batch or model"
        )


def _state_factor(optimizer: OptimizerConfig) -> int:
    if optimizer.kind is Optimizer.ADAM:
        return 2
    return 1 if optimizer.momentum > 0 else 0


def measured_apart(path: Path, batch: int, optimizer: OptimizerConfig) -> BackgroundMemory:
    """:func:`background_memory`, measured in a process of its own (the model's code never runs here)."""
    argv = [sys.executable, "-m", "deeppool.multiplex.preflight", str(path), str(batch), optimizer.kind.value,
            repr(optimizer.lr), repr(optimizer.momentum)]
    done = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        reason = errors[-1].removeprefix("error: ") if errors else (done.stderr.strip().splitlines() or ["?"])[-1]
        raise DeeppoolError(reason)
    return BackgroundMemory(**json.loads(lines[-1]))


def background_memory(path: Path, batch: int, optimizer: OptimizerConfig) -> BackgroundMemory:
    """Estimate without allocating: the model on the meta device, one forward pass counting outputs."""
    loaded = load_model(ModelSpec.parse(str(path)), meta=True)
    params = sum(p.numel() * p.element_size() for p in loaded.module.parameters())
    return BackgroundMemory(params=params, gradients=params, optimizer_state=params * _state_factor(optimizer),
                            activations=_activation_bytes(loaded.module, lambda: loaded.inputs(batch)))


def _activation_bytes(module: torch.nn.Module, make_inputs: Callable[[], object]) -> int:
    total = 0

    def count(_module: torch.nn.Module, _args: object, output: object) -> None:
        nonlocal total
        if isinstance(output, torch.Tensor):
            total += output.numel() * output.element_size()

    leaves = [m for m in module.modules() if not list(m.children())]
    handles = [m.register_forward_hook(count) for m in leaves]
    try:
        inputs = _meta(make_inputs())
        with torch.device("meta"):
            forward(module, inputs)
    except Exception:  # noqa: BLE001  an op without a meta kernel: count parameters only
        total = 0
    finally:
        for handle in handles:
            handle.remove()
    return total


def _meta(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, dict):
        return {k: _meta(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_meta(v) for v in value)
    return value


def main() -> None:
    """``python -m deeppool.multiplex.preflight MODEL BATCH OPTIMIZER LR MOMENTUM``: the estimate as JSON."""
    model, batch, kind, lr, momentum = sys.argv[1:6]
    try:
        memory = background_memory(Path(model), int(batch),
                                   OptimizerConfig(kind=Optimizer(kind), lr=float(lr), momentum=float(momentum)))
    except DeeppoolError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    print(json.dumps(memory.__dict__))  # the last line: whatever the model printed comes before it


if __name__ == "__main__":
    main()
