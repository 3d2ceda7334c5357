"""Fidelity model: an Inception-style CNN, three conv-BN-ReLU branches joined by torch.cat, twice."""

import torch
import torch.nn.functional as F
from torch import nn


class ConvBN(nn.Sequential):
    def __init__(self, cin: int, cout: int, k: int, stride: int = 1) -> None:
        super().__init__(nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU())


class Inception(nn.Module):
    def __init__(self, cin: int, width: int) -> None:
        super().__init__()
        self.b1 = ConvBN(cin, width, 1)
        self.b2 = nn.Sequential(ConvBN(cin, width, 1), ConvBN(width, width, 3))
        self.b3 = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), ConvBN(cin, width, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b2(x), self.b3(x)], 1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = ConvBN(3, 32, 3, stride=2)
        self.one = Inception(32, 32)
        self.two = Inception(96, 64)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(192, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.two(self.one(self.stem(x)))), 1))


def model() -> nn.Module:
    return Net()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, 3, 32, 32, generator=torch.Generator().manual_seed(0)),)


def targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, 10, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
