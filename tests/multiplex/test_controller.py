"""The slowdown controller: additive increase under the target, multiplicative decrease over it."""

from __future__ import annotations

import pytest

from deeppool.errors import DeeppoolError
from deeppool.multiplex.controller import ControllerConfig, SlowdownController


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


def test_waits_for_fresh_samples_after_each_decrease() -> None:
    c = SlowdownController(ControllerConfig(target=0.05, start=0.8, decrease=0.5, samples=3))
    shares = [c.observe(120.0, 100.0) for _ in range(6)]
    assert shares == pytest.approx([0.8, 0.8, 0.4, 0.4, 0.4, 0.2])  # one cut per three slow iterations


def test_one_outlier_is_ignored() -> None:
    c = SlowdownController(ControllerConfig(target=0.05, start=0.5, increase=0.05, samples=3))
    c.observe(100.0, 100.0)
    c.observe(150.0, 100.0)
    assert c.observe(101.0, 100.0) == pytest.approx(0.55)  # median 1.01: under 1.05
    assert c.backoffs == 0


def test_bad_bounds_are_refused() -> None:
    with pytest.raises(DeeppoolError):
        ControllerConfig(floor=0.5, start=0.2)
    with pytest.raises(DeeppoolError):
        ControllerConfig(samples=0)
