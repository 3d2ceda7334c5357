"""AdaScale: the gain's limits, and the same loss curve against τ at any scale."""

from __future__ import annotations

import statistics

import pytest
import torch

from deeppool.adaptation.adascale import AdaScale, gain_ratio
from deeppool.adaptation.gns import GroupNorms, NoiseScale, step_estimate
from deeppool.adaptation.goodput import statistical_efficiency


def test_gain_limits() -> None:
    assert gain_ratio(0.0, 5.0, base_batch=8, batch=64) == 1.0  # no noise: a larger batch buys nothing
    assert gain_ratio(3.0, 0.0, base_batch=8, batch=64) == pytest.approx(8.0)  # pure noise: linear scaling
    assert 1.0 < gain_ratio(3.0, 0.1, base_batch=8, batch=64) < 8.0
    assert gain_ratio(float("nan"), 1.0, base_batch=8, batch=64) == 1.0


def test_efficiency_is_gain_over_scale() -> None:
    trace, sq, base, batch = 40.0, 2.0, 8, 64
    gain = gain_ratio(trace, sq, base_batch=base, batch=batch)
    assert statistical_efficiency(batch, base_batch=base, noise_scale=trace / sq) == pytest.approx(gain / (batch / base))


def train(scale: int, tau_end: float, seed: int, base: int = 4, dim: int = 16, sigma: float = 2.0) -> list[tuple[float, float]]:
    """SGD on ½|w|² with per-sample gradients w + ξ; (τ, loss) after every step."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.full((dim,), 3.0, dtype=torch.float64)
    batch = base * scale
    ada, noise = AdaScale(base_batch=base, batch=batch), NoiseScale(smoothing=0.2)
    curve = []
    while ada.tau < tau_end:
        samples = w + sigma * torch.randn(batch, dim, generator=gen, dtype=torch.float64)
        halves = samples.view(2, batch // 2, dim).mean(dim=1)
        noise.update(step_estimate([GroupNorms(small_sq=float(halves.pow(2).sum(dim=1).mean()), small_batch=batch // 2,
                                               large_sq=float(samples.mean(dim=0).pow(2).sum()), large_batch=batch)]))
        lr = ada.step(noise.trace, noise.grad_sq, lambda tau: 0.05)
        w = w - lr * samples.mean(dim=0)
        curve.append((ada.tau, 0.5 * float(w.pow(2).sum())))
    return curve


def loss_at(curve: list[tuple[float, float]], tau: float) -> float:
    return next(loss for t, loss in curve if t >= tau)


def floor(curve: list[tuple[float, float]]) -> float:
    return statistics.fmean(loss for t, loss in curve if t >= 100.0)


def test_loss_against_tau_overlaps_at_scales_1_and_8() -> None:
    small = [train(1, 170, seed) for seed in range(8)]
    large = [train(8, 170, 100 + seed) for seed in range(8)]
    for tau in (5.0, 10.0, 20.0, 40.0):  # the descent, from a loss of 72
        a = statistics.fmean(loss_at(c, tau) for c in small)
        b = statistics.fmean(loss_at(c, tau) for c in large)
        assert b == pytest.approx(a, rel=0.25), tau
    # the noise floor, where single steps are noisy: averaged over tau in [100, 170]
    assert statistics.fmean(map(floor, large)) == pytest.approx(statistics.fmean(map(floor, small)), rel=0.5)
    assert statistics.fmean(len(c) for c in large) < 0.5 * statistics.fmean(len(c) for c in small)  # fewer steps


def test_tau_survives_checkpoint_and_resume() -> None:
    ada = AdaScale(base_batch=4, batch=32)
    for _ in range(3):
        ada.step(10.0, 1.0, lambda tau: 0.1)
    resumed = AdaScale(base_batch=4, batch=32)
    resumed.load_state_dict(ada.state_dict())
    assert resumed.tau == ada.tau > 3.0
