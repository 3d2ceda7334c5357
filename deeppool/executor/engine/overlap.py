"""Gradient all-reduce overlapped with a stage's backward, as DDP overlaps it.

Each parameter of a stage on several ranks gets a post-accumulate-grad hook.
A parameter's gradient is final once the backward of the stage that owns it
(the stage of the first layer that uses it, whose backward runs last) has
accumulated it; the hook then marks it ready. Layers are handed to the
reducer strictly in the backward's layer order (last layer first): a layer
goes as soon as it and every layer after it in that order are ready, so a
bucket's asynchronous all-reduce starts while the rest of the stage's backward
runs. What the backward never reached (a parameter with no gradient) goes at
the end of the stage's backward, in the same order.

Every rank of a stage runs the same autograd graph, whose execution order is
deterministic, so all ranks hand layers over (and issue the group's
collectives, synchronised BatchNorm's included) in one order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deeppool.executor.engine.program import Stage

HandOver = Callable[[str, tuple[int, ...]], None]
"""Hands one layer's gradients to the reducer over a group of ranks."""


class StageOverlap:
    """Tracks which layers' gradients are final during one stage's backward."""

    def __init__(self, stage: Stage, reduce_params: dict[str, tuple[str, ...]], hand_over: HandOver) -> None:
        self.stage = stage
        self._order = tuple(reversed(stage.layers))
        self._params = {layer: frozenset(reduce_params.get(layer, ())) for layer in self._order}
        self._owner = {name: layer for layer, names in self._params.items() for name in names}
        self._ranks = tuple(range(stage.gpus))
        self._hand_over = hand_over
        self._ready: set[str] = set()
        self._next = 0
        self.active = False

    def owns(self, name: str) -> bool:
        return name in self._owner

    def start(self) -> None:
        self._ready.clear()
        self._next = 0
        self.active = True

    def ready(self, name: str) -> None:
        """The gradient of parameter ``name`` is final; hand over every layer now complete, in order."""
        self._ready.add(name)
        while self._next < len(self._order) and self._params[self._order[self._next]] <= self._ready:
            self._advance()

    def finish(self) -> None:
        """Hand over the layers the backward did not complete, in order."""
        while self._next < len(self._order):
            self._advance()
        self.active = False

    def _advance(self) -> None:
        layer = self._order[self._next]
        self._next += 1
        self._hand_over(layer, self._ranks)


def install_hooks(params: dict[str, nn.Parameter], overlaps: list[StageOverlap]) -> None:
    """One post-accumulate-grad hook per trained parameter that an overlapped stage owns.

    A frozen parameter (``requires_grad=False``: Whisper's sinusoidal positions) never gets a
    gradient, so its layer goes at the end of the stage's backward, as a parameter the backward
    did not reach does.
    """
    for name, param in params.items():
        owner = next((overlap for overlap in overlaps if overlap.owns(name)), None)
        if owner is not None and param.requires_grad:
            param.register_post_accumulate_grad_hook(_hook(owner, name))


def _hook(overlap: StageOverlap, name: str) -> Callable[[torch.Tensor], None]:
    def ready(param: torch.Tensor) -> None:
        del param
        if overlap.active:
            overlap.ready(name)

    return ready
