"""Refused: a buffer updated in ``forward`` from the batch's values (a hand-written running mean).

``self.mean`` moves towards ``x.mean(0)``: split across GPUs each rank would average only its
samples, so the buffer would differ from one process's. ``deeppool plan`` must refuse it with
one line naming the buffer ``norm.mean`` (torch.fx would run the update eagerly while tracing
and silently leave it out of the graph).
"""

import torch
from torch import nn


class RunningMean(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
        return x - self.mean


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.norm = RunningMean(16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.norm(self.fc(x))))


def model() -> nn.Module:
    torch.manual_seed(0)
    return Net().train()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 8, generator=g),)
