"""Straggler detection (an injected 0.5x rank is found, healthy noisy ranks never are) and goodput."""

from __future__ import annotations

import random

import pytest

from deeppool.adaptation.goodput import goodput_table, statistical_efficiency
from deeppool.adaptation.stragglers import StragglerDetector
from deeppool.plans.goodput import best


def run(slow: dict[int, float], steps: int = 200, ranks: int = 8, seed: int = 0) -> list:
    rng = random.Random(seed)
    detector, found = StragglerDetector(), []
    for step in range(steps):
        times = {r: 10.0 * rng.uniform(0.85, 1.15) / slow.get(r, 1.0) for r in range(ranks)}
        found += detector.observe(step, times)
    return found


def test_an_injected_slow_rank_is_flagged_once() -> None:
    found = run({5: 0.5})
    assert [s.rank for s in found] == [5]
    assert found[0].relative_speed < 0.8 and found[0].step < 40
    assert "rank 5 is a straggler" in found[0].describe()


@pytest.mark.parametrize("seed", range(5))
def test_healthy_ranks_with_noise_are_never_flagged(seed: int) -> None:
    assert run({}, steps=1000, seed=seed) == []


def test_in_a_group_of_two_the_slow_rank_is_the_one_flagged() -> None:
    found = run({1: 0.5}, ranks=2)
    assert [s.rank for s in found] == [1] and found[0].relative_speed < 0.6


def test_outlier_steps_of_the_other_ranks_do_not_hide_a_straggler() -> None:
    """Every 8th step the other ranks are descheduled (5x slower): the half-speed rank is still found."""
    detector, found = StragglerDetector(patience=20), []
    for step in range(100):
        others = 50.0 if step % 8 == 0 else 10.0
        found += detector.observe(step, {0: others, 1: others, 2: others, 3: 20.0})
    assert [s.rank for s in found] == [3]


def test_a_slowdown_shorter_than_the_time_floor_is_noise() -> None:
    """1 ms steps: a rank at half speed for 500 steps (0.5 s) is not reported under a 2 s floor; for 3,000 it is,
    once its slow steps add up to 2 s."""
    for slow_steps, reported in ((500, False), (3000, True)):
        detector, found = StragglerDetector(alpha=0.05, patience=30, min_slow_ms=2000.0), []
        for step in range(4000):
            slow = 1000 <= step < 1000 + slow_steps
            found += detector.observe(step, {0: 0.5, 1: 1.0 if slow else 0.5}, step_ms=1.0)
        assert [s.rank for s in found] == ([1] if reported else [])
        if reported:
            assert 3000 <= found[0].step < 3100  # 2 s of slow steps after the EWMA crosses 0.8 (about step 1008)


def test_goodput_prefers_the_batch_where_throughput_and_efficiency_balance() -> None:
    assert statistical_efficiency(64, base_batch=64, noise_scale=500.0) == 1.0
    assert statistical_efficiency(1024, base_batch=64, noise_scale=0.0) == pytest.approx(64 / 1024)
    # iteration time: a fixed 10 ms plus 0.1 ms per sample; throughput grows with the batch, efficiency falls
    table = goodput_table([64, 128, 256, 512, 1024, 4096], lambda b: 0.010 + 1e-4 * b, base_batch=64,
                          noise_scale=300.0)
    choice = best(table)
    assert [c.batch for c in table] == [64, 128, 256, 512, 1024, 4096]
    assert choice.batch not in (64, 4096)  # an interior optimum
    assert choice.goodput == max(c.throughput * c.efficiency for c in table)
