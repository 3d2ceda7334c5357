"""The gradient noise scale, AdaScale and Adasum in the executor, on real gloo processes.

The model is ``tests/executor/models/noisy_quadratic.py``: per-sample gradients
``g_i = (w − w*) + ξ_i`` with ``ξ_i ~ N(0, σ²I)`` drawn fresh every step, so the
true ``|G|² = |w − w*|²``, ``tr(Σ) = dσ²`` and noise scale ``dσ²/|w − w*|²``
are known. Its three parameter blocks run on layer groups of 2, 4 and 8 ranks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics

import numpy as np
import pytest
import torch

from deeppool.adaptation.adasum import adasum
from deeppool.executor.config import (
    Adaptation,
    CheckpointConfig,
    LrScaling,
    Monitor,
    OptimizerConfig,
    RunConfig,
    Training,
)
from deeppool.plans import Combine, Optimizer, Plan, sample_ranges
from tests.executor.gloo import Job, Outcome, train_gloo
from tests.executor.models.noisy_quadratic import START, WIDTH
from tests.executor.plans import make_plan

pytestmark = pytest.mark.slow

BATCH, SIGMA, STEPS = 16, 1.0, 40
BLOCKS = {"add": ("a.weight", 0), "add_1": ("b.weight", 1), "add_2": ("c.weight", 2)}
"""The quadratic's parameter layers: their parameter and block index (its columns of the input)."""
Z_BOUND = 4.0
"""Standard errors an estimate may be off the truth."""


def noise(seed: int, steps: int, batch: int, sigma: float, shift: float = 0.0) -> list:
    """``steps`` global batches of ``x_i = shift + σ·ξ_i`` (inputs and targets alike)."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        x = shift + sigma * torch.randn(batch, 3 * WIDTH, generator=g)
        batches.append(((x,), x))
    return batches


def quadratic_plan(sizes: tuple[int, int, int], *, gpus: int, batch: int = BATCH) -> Plan:
    """Blocks a, b, c on ``sizes`` GPUs; the glue layers on one."""
    layers = {name: sizes[index] for name, (_, index) in BLOCKS.items()}
    return make_plan("noisy_quadratic", global_batch=batch, gpus=gpus, assign=lambda i, layer: layers.get(layer.name, 1))


BURST = quadratic_plan((2, 4, 8), gpus=8)
ODD = quadratic_plan((3, 5, 6), gpus=8)
GNS = Adaptation(monitor=Monitor.GNS)
STILL = OptimizerConfig(lr=1e-9)
"""A step too small to move ``w``: every step samples the same true gradient."""


@pytest.fixture(scope="module")
def eight_ranks() -> list[list[Outcome]]:
    """One set of 8 gloo processes: the noise scale at σ and at 0, and Adasum on two plans."""
    one_step = functools.partial(noise, 3, 1, BATCH, SIGMA)
    jobs = [
        Job(plan=BURST, config=RunConfig(steps=STEPS, optimizer=STILL, adaptation=GNS, bucket_mb=0.0005),
            data=functools.partial(noise, 1, STEPS, BATCH, SIGMA)),
        Job(plan=BURST, config=RunConfig(steps=5, optimizer=STILL, adaptation=GNS),
            data=functools.partial(noise, 2, 5, BATCH, 0.0)),
        Job(plan=BURST, config=RunConfig(steps=1, optimizer=OptimizerConfig(lr=1.0),
                                         adaptation=Adaptation(combine=Combine.ADASUM)), data=one_step),
        Job(plan=dataclasses.replace(ODD, combine=Combine.ADASUM), config=RunConfig(steps=1, optimizer=OptimizerConfig(lr=1.0)),
            data=one_step),
    ]
    return train_gloo(jobs)


def mean_and_error(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) / math.sqrt(len(values))


def ratio_and_error(traces: list[float], squares: list[float], shrink: float = 1.0) -> tuple[float, float]:
    """``mean(tr Σ) / mean(|G|²)`` and its standard error by the delta method.

    ``se² = (var t + R² var g − 2R cov(t, g)) / (n ḡ²)``, over the ``n`` independent steps; ``shrink``
    scales the variance for an average other than the plain mean (an EMA: ``α/(2−α)·n``).
    """
    t, g = np.array(traces), np.array(squares)
    ratio = t.mean() / g.mean()
    cov = np.cov(t, g)
    var = (cov[0, 0] + ratio**2 * cov[1, 1] - 2 * ratio * cov[0, 1]) / (len(t) * g.mean() ** 2)
    return float(ratio), float(math.sqrt(var * shrink))


def test_each_group_estimates_its_blocks_squared_gradient_and_trace(eight_ranks) -> None:
    readings = eight_ranks[0][0].gns
    assert len(readings) == STEPS and all(r.groups == 3 and r.skipped == 0 for r in readings)
    params = eight_ranks[0][0].params
    for size, (name, index) in zip((2, 4, 8), BLOCKS.values(), strict=True):
        true_sq, true_trace = float(np.sum(params[name].astype(np.float64) ** 2)), WIDTH * SIGMA**2
        assert readings[0].per_group[index][0] == size
        sq, sq_error = mean_and_error([r.per_group[index][1] for r in readings])
        trace, trace_error = mean_and_error([r.per_group[index][2] for r in readings])
        assert abs(sq - true_sq) <= Z_BOUND * sq_error, (size, sq, sq_error, true_sq)
        assert abs(trace - true_trace) <= Z_BOUND * trace_error, (size, trace, trace_error, true_trace)
        assert trace_error < 0.1 * true_trace  # the interval is narrow enough to mean something


def test_the_noise_scale_matches_d_sigma_squared_over_the_squared_gradient(eight_ranks) -> None:
    rank0 = eight_ranks[0][0]
    truth = 3 * WIDTH * SIGMA**2 / (3 * WIDTH * START**2)  # 16 samples
    traces, squares = [r.trace for r in rank0.gns], [r.grad_sq for r in rank0.gns]
    ratio, error = ratio_and_error(traces, squares)
    assert abs(ratio - truth) <= Z_BOUND * error and error < 0.15 * truth, (ratio, error)
    alpha = 0.1  # the EMA of the summary: its variance is about α/(2−α) of one step's, i.e. n·α/(2−α) of the mean's
    reported = rank0.summary["gns"]
    _, ema_error = ratio_and_error(traces, squares, shrink=len(traces) * alpha / (2 - alpha))
    assert abs(reported - truth) <= Z_BOUND * ema_error, (reported, ema_error)
    assert rank0.summary["gns_stats"]["noise_scale"] == reported
    counters = rank0.counted("gns")
    assert [c.step for c in counters] == list(range(STEPS))
    assert counters[-1].values["noise_scale"] == pytest.approx(reported)
    assert all(not outcome.gns and not outcome.counted("gns") for outcome in eight_ranks[0][1:])


def test_without_noise_the_noise_scale_is_zero(eight_ranks) -> None:
    rank0 = eight_ranks[1][0]
    assert rank0.summary["gns"] == pytest.approx(0.0, abs=1e-9)
    assert rank0.summary["gns_stats"]["grad_sq_ema"] == pytest.approx(3 * WIDTH * START**2, rel=1e-6)


def per_rank_gradients(plan: Plan, x: torch.Tensor, w: np.ndarray, size: int, index: int) -> list[torch.Tensor]:
    """Each rank's own mean gradient of block ``index`` on ``size`` ranks: ``w + mean x_i`` over its rows."""
    columns = x[:, index * WIDTH:(index + 1) * WIDTH].double()
    return [torch.from_numpy(w).double() + columns[a:b].mean(0) for a, b in sample_ranges(plan.global_batch, size)]


@pytest.mark.parametrize(("job", "plan", "sizes"), [(2, BURST, (2, 4, 8)), (3, ODD, (3, 5, 6))],
                         ids=["2-4-8-ranks", "3-5-6-ranks"])
def test_adasum_combines_each_layer_as_the_single_process_reference(eight_ranks, job: int, plan: Plan,
                                                                    sizes: tuple[int, ...]) -> None:
    """One SGD step at lr 1 from ``w = START``: ``START − w`` is the combined gradient."""
    (x,), _ = noise(3, 1, BATCH, SIGMA)[0]
    start = np.full(WIDTH, START, dtype=np.float32)
    for (name, index), size in zip(BLOCKS.values(), sizes, strict=True):
        want = adasum(per_rank_gradients(plan, x, start, size, index))
        mean = torch.from_numpy(start).double() + x[:, index * WIDTH:(index + 1) * WIDTH].double().mean(0)
        assert not torch.allclose(want, mean, rtol=1e-3)  # Adasum is not the mean here
        for rank in range(size):
            got = torch.from_numpy(start - eight_ranks[job][rank].params[name]).double()
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (name, rank, (got - want).abs().max())


SMALL, LARGE = quadratic_plan((2, 2, 2), gpus=2, batch=2), quadratic_plan((2, 2, 2), gpus=2, batch=BATCH)
"""Two ranks at AdaScale's base batch of 2 (S = 1) and at 16 (S = 8)."""
LR, BASE_STEPS, SCALED_STEPS, ACCUMULATED_STEPS = 0.02, 250, 40, 30
ADASCALE = Adaptation(lr_scaling=LrScaling.ADASCALE, base_batch=2)


def adascale(steps: int, *, optimizer: OptimizerConfig = OptimizerConfig(lr=LR),
             checkpoint: CheckpointConfig | None = None) -> RunConfig:
    return RunConfig(steps=steps, optimizer=optimizer, adaptation=ADASCALE, checkpoint=checkpoint)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[list[Outcome]]:
    """One set of 2 gloo processes: AdaScale at S = 1 and 8, without noise, without a gradient, resumed."""
    folder = tmp_path_factory.mktemp("adascale")
    resumable = functools.partial(noise, 6, 6, BATCH, SIGMA)
    jobs = [
        Job(plan=SMALL, config=adascale(BASE_STEPS), data=functools.partial(noise, 1, BASE_STEPS, 2, SIGMA)),
        Job(plan=LARGE, config=adascale(SCALED_STEPS), data=functools.partial(noise, 2, SCALED_STEPS, BATCH, SIGMA)),
        Job(plan=LARGE, config=adascale(3), data=functools.partial(noise, 3, 3, BATCH, 0.0)),
        Job(plan=LARGE, config=adascale(20, optimizer=STILL), data=functools.partial(noise, 4, 20, BATCH, SIGMA, -START)),
        Job(plan=LARGE, config=adascale(2, optimizer=OptimizerConfig(kind=Optimizer.ADAM, lr=LR)),
            data=functools.partial(noise, 5, 2, BATCH, SIGMA, -START)),
        Job(plan=LARGE, config=adascale(6), data=resumable),
        Job(plan=LARGE, config=adascale(3, checkpoint=CheckpointConfig(directory=folder, every=3)), data=resumable),
        Job(plan=LARGE, config=adascale(6, checkpoint=CheckpointConfig(directory=folder, every=3, resume=True)),
            data=resumable),
        Job(plan=LARGE, config=RunConfig(steps=ACCUMULATED_STEPS, optimizer=STILL, adaptation=GNS,
                                         training=Training(accumulate=2)),
            data=functools.partial(noise, 7, 2 * ACCUMULATED_STEPS, BATCH, SIGMA)),
    ]
    return train_gloo(jobs)


def progress(outcome: Outcome) -> tuple[np.ndarray, np.ndarray]:
    """Each step's gain and its τ before the step (the τ its loss was measured at)."""
    counted = outcome.counted("adascale")
    gains = np.array([c.values["gain"] for c in counted])
    return gains, np.array([c.values["tau"] for c in counted]) - gains


def test_loss_against_tau_overlaps_at_scale_1_and_8(two_ranks) -> None:
    """On the quadratic, AdaScale at S = 8 follows the S = 1 curve against τ in about 6x fewer steps."""
    base_loss = np.sum([o.losses for o in two_ranks[0]], axis=0)
    base_gains, base_tau = progress(two_ranks[0][0])
    assert np.all(base_gains == 1.0) and np.array_equal(base_tau, np.arange(BASE_STEPS))
    loss = np.sum([o.losses for o in two_ranks[1]], axis=0)
    gains, tau = progress(two_ranks[1][0])
    assert np.all((gains >= 1) & (gains <= 8)) and tau[-1] > 200  # > 5 base steps per step
    descent = tau <= 100
    gap = np.abs(np.log(loss[descent] / np.interp(tau[descent], base_tau, base_loss)))
    assert gap.max() < 0.3, gap  # within 35% while the loss falls fourfold
    floor, base_floor = loss[(tau >= 150) & (tau <= 250)].mean(), base_loss[150:250].mean()
    assert abs(floor / base_floor - 1) < 0.2, (floor, base_floor)
    assert two_ranks[1][0].summary["adascale"]["tau"] == pytest.approx(tau[-1] + gains[-1])


def test_without_noise_the_gain_is_1_and_without_a_gradient_it_is_the_scale(two_ranks) -> None:
    for outcome in two_ranks[2]:
        gains, tau = progress(outcome)
        assert gains == pytest.approx([1.0] * 3, abs=1e-9) and tau == pytest.approx([0.0, 1.0, 2.0], abs=1e-8)
    gains, _ = progress(two_ranks[3][1])
    assert gains.min() > 7.5 and gains.max() == pytest.approx(8.0)
    summary = two_ranks[3][0].summary["adascale"]
    assert summary["scale"] == 8.0 and summary["base_batch"] == 2 and summary["gain"] == gains[-1]
    adam = two_ranks[4][0].counted("adascale")
    assert [c.values["lr"] for c in adam] == pytest.approx([math.sqrt(c.values["gain"]) * LR for c in adam])
    assert min(c.values["gain"] for c in adam) > 7


def test_tau_and_the_noise_scale_survive_checkpoint_and_resume(two_ranks) -> None:
    whole, first, resumed = two_ranks[5], two_ranks[6], two_ranks[7]
    for mine, theirs in zip(resumed, whole, strict=True):
        assert all(np.array_equal(mine.params[name], theirs.params[name]) for name in theirs.params)
        assert mine.losses == theirs.losses[3:]
    assert resumed[0].summary["adascale"] == whole[0].summary["adascale"]
    assert resumed[0].summary["gns_stats"] == {**whole[0].summary["gns_stats"]}
    assert first[0].summary["adascale"]["tau"] < whole[0].summary["adascale"]["tau"]


def test_with_accumulation_the_noise_scale_is_measured_on_the_steps_samples(two_ranks) -> None:
    """Two micro-batches of 16 per step: small batches of 16 per rank, large of 32; the truth is unchanged."""
    readings = two_ranks[8][0].gns
    assert len(readings) == ACCUMULATED_STEPS
    ratio, error = ratio_and_error([r.trace for r in readings], [r.grad_sq for r in readings])
    truth = 3 * WIDTH * SIGMA**2 / (3 * WIDTH * START**2)
    assert abs(ratio - truth) <= Z_BOUND * error and error < 0.15 * truth, (ratio, error)
