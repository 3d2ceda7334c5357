"""A background model whose layers form a DAG: one value is read by two later layers (a residual) and one
weight by two layers (tied), so a step cut into pieces sums gradients across them."""

import torch
import torch.nn.functional as F
from torch import nn


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.a, self.b, self.out = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 4)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        y = self.b(torch.relu(self.a(h))) + h
        return self.out(torch.tanh(y))


def model() -> nn.Module:
    return Residual()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, 16),)


def targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, 4, (batch_size,))


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
