"""An Inception-style net: parallel conv branches joined by torch.cat, conv-BN-ReLU."""

import torch
import torch.nn.functional as F
from torch import nn


class ConvBN(nn.Module):
    def __init__(self, cin: int, cout: int, k: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, padding=k // 2, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


class Inception(nn.Module):
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.b1 = ConvBN(cin, 4, 1)
        self.b2 = nn.Sequential(ConvBN(cin, 3, 1), ConvBN(3, 4, 3))
        self.b3 = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), ConvBN(cin, 4, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b2(x), self.b3(x)], 1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = ConvBN(3, 6, 3)
        self.block = Inception(6)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.block(self.stem(x))), 1))


def model() -> nn.Module:
    return Net()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, 6, 6, generator=g),)


def targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 4, (batch_size,), generator=g)


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
