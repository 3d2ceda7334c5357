"""The policy types and the built-in grow-batch rule, on snapshots built here; loading --policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from deeppool.adaptation.policy import GrowBatch, Hooks, SetAccumulate, SetLr, TrainingSnapshot, load_policy
from deeppool.errors import DeeppoolError

POLICIES = Path(__file__).resolve().parent / "policies.py"


def snapshot(*, step: int = 10, accumulate: int = 1, gns: float | None = None) -> TrainingSnapshot:
    return TrainingSnapshot(step=step, position=step, gpus=2, global_batch=32, accumulate=accumulate, lr=0.1,
                            step_ms=(10.0, 20.0), compute_ms=(5.0, 6.0), gns=gns)


def test_grow_batch_doubles_accumulation_while_the_noise_scale_is_large() -> None:
    policy = GrowBatch()
    assert policy.after_step(snapshot(gns=1000.0)) == (SetAccumulate(accumulate=2),)  # 4 x 32 <= 1000
    assert policy.after_step(snapshot(accumulate=4, gns=1000.0)) == (SetAccumulate(accumulate=8),)  # 4 x 128 <= 1000
    assert policy.after_step(snapshot(accumulate=8, gns=1000.0)) == ()  # 4 x 256 > 1000: the batch is large enough


def test_grow_batch_waits_for_a_measurement_its_interval_and_its_cap() -> None:
    policy = GrowBatch(interval=10, max_accumulate=8)
    assert policy.after_step(snapshot(gns=None)) == ()
    assert policy.after_step(snapshot(step=11, gns=1e6)) == ()
    assert policy.after_step(snapshot(accumulate=8, gns=1e6)) == ()
    assert policy.after_step(snapshot(accumulate=6, gns=1e6)) == (SetAccumulate(accumulate=8),)
    assert policy.before_step(snapshot(gns=1e6)) == () and policy.after_epoch(snapshot(gns=1e6)) == ()


def test_a_snapshot_knows_its_batch_and_throughput() -> None:
    shot = snapshot(accumulate=4)
    assert shot.batch == 128 and shot.samples_per_s == pytest.approx(128 / 0.020)
    assert TrainingSnapshot(step=0, position=0, gpus=1, global_batch=8, accumulate=1, lr=0.1).samples_per_s is None


def test_actions_and_settings_out_of_range_are_refused() -> None:
    with pytest.raises(DeeppoolError, match="learning rate"):
        SetLr(lr=0.0)
    with pytest.raises(DeeppoolError, match="accumulation"):
        SetAccumulate(accumulate=0)
    with pytest.raises(DeeppoolError, match="grow-batch"):
        GrowBatch(factor=0.5)


def test_policies_load_by_name_module_or_file() -> None:
    assert isinstance(load_policy("grow-batch"), GrowBatch)
    assert isinstance(load_policy("tests.adaptation.policies:halve_lr"), Hooks)
    assert load_policy(f"{POLICIES}:one_gpu").after_step(snapshot(step=2)) != ()
    for wrong, message in [("grow", "neither a built-in"), (f"{POLICIES}:nothing", "no function 'nothing'"),
                           ("no.such.module:f", "cannot import"), ("missing.py:f", "no file")]:
        with pytest.raises(DeeppoolError, match=message):
            load_policy(wrong)
