"""A tiny residual MLP in the model-file convention, for fast CLI tests."""

import torch
from torch import nn


class TinyResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(32, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(self.act(self.fc1(x))) + x)


def model() -> nn.Module:
    return TinyResidual()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, 16, generator=torch.Generator().manual_seed(0)),)
