"""What is refused before a rank starts, each with one line."""

from __future__ import annotations

import pytest

from deeppool.errors import DeeppoolError
from deeppool.executor.config import OptimizerConfig
from deeppool.multiplex.config import BackgroundConfig, MuxMode
from deeppool.multiplex.preflight import Machine, background_memory, check, check_mode
from deeppool.plans import Optimizer
from tests.multiplex.plans import BACKGROUND, MODELS, burst_plan

CPU = Machine(cuda=False, mps_control=False, device_bytes=16 * 2**30)


@pytest.fixture(scope="module")
def plan():
    return burst_plan()


def test_a_plan_without_idle_windows_has_nothing_to_lend(plan) -> None:
    flat = burst_plan(lone=())
    with pytest.raises(DeeppoolError, match="no idle windows.*nothing to lend"):
        check(flat, BackgroundConfig(model=BACKGROUND), CPU)


@pytest.mark.parametrize("mode", [MuxMode.PRIORITY, MuxMode.MPS])
def test_gpu_modes_need_a_gpu(mode: MuxMode) -> None:
    with pytest.raises(DeeppoolError, match=f"--mux {mode.value} needs a CUDA GPU"):
        check_mode(mode, CPU)


def test_mps_needs_its_control_tool() -> None:
    with pytest.raises(DeeppoolError, match="nvidia-cuda-mps-control"):
        check_mode(MuxMode.MPS, Machine(cuda=True, mps_control=False, device_bytes=2**30))


def test_a_model_file_that_does_not_load(plan) -> None:
    with pytest.raises(DeeppoolError, match="failed to import"):
        check(plan, BackgroundConfig(model=MODELS / "broken_bg.py"), CPU)


def test_a_model_that_does_not_fit_is_refused_with_the_numbers(plan) -> None:
    with pytest.raises(DeeppoolError, match=r"needs \d+\.\d+ GiB .* device has 16\.00 GiB"):
        check(plan, BackgroundConfig(model=MODELS / "huge_bg.py"), CPU)


def test_memory_counts_optimizer_state_and_activations() -> None:
    sgd = background_memory(BACKGROUND, 8, OptimizerConfig())
    adam = background_memory(BACKGROUND, 8, OptimizerConfig(kind=Optimizer.ADAM))
    assert sgd.optimizer_state == 0 and adam.optimizer_state == 2 * adam.params
    assert adam.activations > 0 and background_memory(BACKGROUND, 16, OptimizerConfig()).activations == 2 * sgd.activations


def test_a_fitting_job_passes(plan) -> None:
    assert check(plan, BackgroundConfig(model=BACKGROUND), CPU).total < 2**30
