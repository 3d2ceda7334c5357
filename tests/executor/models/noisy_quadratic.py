"""A quadratic whose per-sample gradient is known: ``g_i = w + x_i``.

Three parameter blocks, each a vector added to its slice of the input
(``out_i = x_i + w``; the targets are the inputs). The loss of sample ``i`` is
``½|w|² + x_i·(w − sg(w))`` with ``sg`` stopping the gradient: its value is
``½|w|²`` and its gradient with respect to ``w`` is ``w + x_i``. Feeding ``x_i = c + ξ_i`` with ``ξ_i ~ N(0, σ²I)`` gives
``g_i = (w − w*) + ξ_i`` with ``w* = −c``, and the gradient noise scale
``B_noise = dσ² / |w − w*|²`` (``d = 3·WIDTH`` coordinates); every block
alone has ``WIDTH·σ² / |w_k − w*_k|²``.
"""

import torch
from torch import nn

WIDTH = 256
START = 0.25
"""Every coordinate of ``w`` starts here: ``|w|² = 3·256/16 = 48``."""


class Shift(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((WIDTH,), START))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight


class Quadratic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = Shift(), Shift(), Shift()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b, c = torch.split(x, WIDTH, dim=1)
        return torch.cat([self.a(a), self.b(b), self.c(c)], dim=1)


def model() -> nn.Module:
    return Quadratic()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3 * WIDTH, generator=g),)


def targets(batch_size: int) -> torch.Tensor:
    return inputs(batch_size)[0]


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    w = output - targets
    noise = (targets * w).sum(dim=1)
    return (0.5 * w.pow(2).sum(dim=1) + noise - noise.detach()).mean()
