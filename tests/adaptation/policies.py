"""Policies for the tests, loaded by ``deeppool run --policy tests/adaptation/policies.py:NAME`` on every rank."""

from __future__ import annotations

from collections.abc import Sequence

from deeppool.adaptation.policy import Action, Hooks, RequestGpus, SetAccumulate, SetLr, TrainingSnapshot


class HalveLr(Hooks):
    """Halves the learning rate before the first step."""

    def before_step(self, snapshot: TrainingSnapshot) -> Sequence[Action]:
        return (SetLr(lr=snapshot.lr / 2),) if snapshot.step == 0 else ()


class AccumulateTwo(Hooks):
    """Two micro-batches per optimizer step from step 2 on."""

    def after_step(self, snapshot: TrainingSnapshot) -> Sequence[Action]:
        return (SetAccumulate(accumulate=2),) if snapshot.step == 2 else ()


class OneGpu(Hooks):
    """Asks for one GPU after step 2, unless it runs on one."""

    def after_step(self, snapshot: TrainingSnapshot) -> Sequence[Action]:
        if snapshot.step == 2 and snapshot.gpus != 1:
            return (RequestGpus(gpus=1, reason="the test asks for it"),)
        return ()


def halve_lr() -> HalveLr:
    return HalveLr()


def accumulate_two() -> AccumulateTwo:
    return AccumulateTwo()


def one_gpu() -> OneGpu:
    return OneGpu()
