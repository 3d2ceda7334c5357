"""A background model that trains one step and then raises (a crash mid-run)."""

import torch
from torch import nn


class Crashing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 2)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 1:
            raise RuntimeError("background model blew up")
        return self.fc(x)


def model() -> nn.Module:
    return Crashing()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, 8),)
