"""The noise scale on a problem with known noise: g_i = (w − w*) + ξ_i, ξ_i ~ N(0, σ²I)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from deeppool.adaptation.gns import GroupNorms, NoiseScale, step_estimate

DIM, BATCH = 64, 32


def group_norms(offset: torch.Tensor, sigma: float, ranks: int, gen: torch.Generator) -> GroupNorms:
    """One step of data parallel on ``ranks`` ranks: local squared norms before the all-reduce, global after."""
    samples = offset + sigma * torch.randn(BATCH, offset.numel(), generator=gen, dtype=torch.float64)
    local = samples.view(ranks, BATCH // ranks, -1).mean(dim=1)
    return GroupNorms(small_sq=float(local.pow(2).sum(dim=1).mean()), small_batch=BATCH // ranks,
                      large_sq=float(samples.mean(dim=0).pow(2).sum()), large_batch=BATCH)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_estimates_match_the_known_noise_within_their_confidence_interval(ranks: int) -> None:
    gen = torch.Generator().manual_seed(ranks)
    offset, sigma = torch.full((DIM,), 0.25, dtype=torch.float64), 0.5
    true_sq, true_trace = float(offset.pow(2).sum()), DIM * sigma**2
    estimates = [step_estimate([group_norms(offset, sigma, ranks, gen)]) for _ in range(1500)]
    for values, truth in (([e.grad_sq for e in estimates], true_sq), ([e.trace for e in estimates], true_trace)):
        error = statistics.stdev(values) / math.sqrt(len(values))
        assert abs(statistics.fmean(values) - truth) < 4 * error  # unbiased: the truth lies in the 4-sigma interval
    noise = NoiseScale(smoothing=0.01)
    for estimate in estimates:
        noise.update(estimate)
    assert noise.value == pytest.approx(true_trace / true_sq, rel=0.25)  # 16 samples


def test_no_noise_gives_a_noise_scale_of_about_zero() -> None:
    gen = torch.Generator().manual_seed(0)
    noise = NoiseScale()
    for _ in range(50):
        noise.update(step_estimate([group_norms(torch.ones(DIM, dtype=torch.float64), 0.0, 4, gen)]))
    assert noise.value == pytest.approx(0.0, abs=1e-9)


def test_groups_of_different_sizes_add_up_and_single_rank_groups_are_left_out() -> None:
    gen = torch.Generator().manual_seed(1)
    offset, sigma = torch.full((DIM,), 0.25, dtype=torch.float64), 0.5
    steps = [step_estimate([group_norms(offset[: DIM // 2], sigma, 2, gen), group_norms(offset[DIM // 2:], sigma, 8, gen),
                            group_norms(offset, sigma, 1, gen)]) for _ in range(1500)]
    assert all(s.groups == 2 and s.skipped == 1 for s in steps)
    # the two halves together carry the whole offset and noise; the one-rank group adds nothing
    assert statistics.fmean(s.trace for s in steps) == pytest.approx(DIM * sigma**2, rel=0.1)
    assert statistics.fmean(s.grad_sq for s in steps) == pytest.approx(float(offset.pow(2).sum()), rel=0.15)
    assert step_estimate([group_norms(offset, sigma, 1, gen)]) is None


def test_state_survives_a_round_trip() -> None:
    noise = NoiseScale()
    gen = torch.Generator().manual_seed(2)
    for _ in range(5):
        noise.update(step_estimate([group_norms(torch.ones(DIM, dtype=torch.float64), 0.3, 2, gen)]))
    copy = NoiseScale()
    copy.load_state_dict(noise.state_dict())
    assert copy.value == noise.value and copy.steps == 5
