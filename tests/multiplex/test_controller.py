"""The slowdown controller: additive increase under the target, multiplicative decrease over it."""

from __future__ import annotations

import pytest

from deeppool.errors import DeeppoolError
from deeppool.multiplex.controller import ControllerConfig, SlowdownController, relative_noise


def test_grows_additively_while_under_target_up_to_the_ceiling() -> None:
    c = SlowdownController(ControllerConfig(target=0.05, start=0.5, increase=0.1, ceiling=0.8, samples=1))
    shares = [c.observe(101.0, 100.0) for _ in range(5)]
    assert shares == pytest.approx([0.6, 0.7, 0.8, 0.8, 0.8])
    assert c.backoffs == 0


def test_backs_off_multiplicatively_over_target_down_to_the_floor() -> None:
    c = SlowdownController(ControllerConfig(target=0.05, start=0.8, decrease=0.5, floor=0.1, samples=1))
    shares = [c.observe(120.0, 100.0) for _ in range(4)]
    assert shares == pytest.approx([0.4, 0.2, 0.1, 0.1])
    assert c.backoffs == 4


def test_decides_once_per_group_of_fresh_samples() -> None:
    c = SlowdownController(ControllerConfig(target=0.05, start=0.8, decrease=0.5, samples=3))
    shares = [c.observe(120.0, 100.0) for _ in range(6)]
    assert shares == pytest.approx([0.8, 0.8, 0.4, 0.4, 0.4, 0.2])  # one cut per three slow iterations


def test_one_outlier_is_ignored() -> None:
    c = SlowdownController(ControllerConfig(target=0.05, start=0.5, increase=0.05, samples=3))
    c.observe(100.0, 100.0)
    c.observe(150.0, 100.0)
    assert c.observe(101.0, 100.0) == pytest.approx(0.55)  # median 1.01: under 1.025
    assert c.backoffs == 0


def test_holds_between_half_the_target_and_the_target() -> None:
    c = SlowdownController(ControllerConfig(target=0.05, start=0.5, samples=1))
    assert [c.observe(104.0, 100.0) for _ in range(3)] == pytest.approx([0.5, 0.5, 0.5])
    assert c.backoffs == 0


def test_noise_widens_the_margin_until_enough_samples_show_the_slowdown() -> None:
    quiet = SlowdownController(ControllerConfig(target=0.05, start=0.8, samples=3))
    noisy = SlowdownController(ControllerConfig(target=0.05, start=0.8, samples=3))
    for _ in range(3):
        quiet.observe(110.0, 100.0, noise=0.0)
        noisy.observe(110.0, 100.0, noise=0.1)
    assert quiet.backoffs == 1  # 10% over a quiet baseline: cut at once
    assert noisy.backoffs == 0  # margin 0.1 x 1.25 / sqrt(3) = 7.2%, and 10% < 5% + 7.2%: not yet evidence
    for _ in range(3):
        noisy.observe(110.0, 100.0, noise=0.1)
    assert noisy.backoffs == 0  # n = 6: margin 5.1%
    noisy.observe(110.0, 100.0, noise=0.1)
    assert noisy.backoffs == 1  # n = 7: margin 4.7%, under the 5% the signal is over target


def test_relative_noise_is_robust_to_outliers() -> None:
    assert relative_noise([10.0, 10.0, 10.0]) == 0.0  # too few to tell
    assert relative_noise([9.0, 10.0, 11.0, 10.0, 1000.0]) == pytest.approx(1.4826 * 1.0 / 10.0)


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(DeeppoolError):
        ControllerConfig(floor=0.5, start=0.2)
    with pytest.raises(DeeppoolError):
        ControllerConfig(samples=0)
