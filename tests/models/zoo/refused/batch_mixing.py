"""Refused: an operation that mixes samples and is not BatchNorm.

``Center`` subtracts the mean over the batch (``x - x.mean(dim=0,
keepdim=True)``) in the middle of the model: each sample's output depends on
the other samples, so a layer split across ranks would compute something
else. The model traces fine; ``deeppool run`` must refuse it with one line
naming the module ``center``.
"""

import torch
import torch.nn.functional as F
from torch import nn

CLASSES = 4


class Center(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(dim=0, keepdim=True)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.center = Center()
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.fc1(x))
        x = self.center(x)
        return self.head(self.act(self.fc2(x)))


def model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 8, generator=g),)


def targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
