"""A resumed run asked for another learning rate (a coordinator's batch change: base × AdaScale's gain) takes it,
and a policy's change to the base LR before the checkpoint carries over by the same ratio."""

from __future__ import annotations

import math

from deeppool.executor.training.adapt import Progress


def test_a_resumed_run_scales_its_base_lr_by_the_newly_asked_over_the_old() -> None:
    saved = Progress(accumulate=1, position=40, lr=0.01, asked_lr=0.01)
    resumed = saved.asked(0.015)
    assert math.isclose(resumed.lr, 0.015) and resumed.asked_lr == 0.015 and resumed.position == 40
    halved = Progress(accumulate=1, position=40, lr=0.005, asked_lr=0.01)  # its policy halved the LR
    assert math.isclose(halved.asked(0.015).lr, 0.0075)
    assert saved.asked(0.01) == saved  # asked the same: unchanged
    older = Progress(accumulate=1, position=40, lr=0.005)  # a checkpoint from before asked_lr
    assert older.asked(0.02).lr == 0.005 and older.asked(0.02).asked_lr == 0.02
