"""A ResNet-18-style CNN for the executor benchmark: CIFAR-sized images, BasicBlocks [2, 2, 2, 2].

Widths 32-64-128-256 (half of ResNet-18's, so a CPU step takes tens of
milliseconds), BatchNorm after every convolution, ``[B, 3, 32, 32]`` -> ``[B, 10]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

CLASSES = 10
WIDTHS = (32, 64, 128, 256)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.down is None else self.down(x)
        return F.relu(out + identity)


class ResNet18(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, WIDTHS[0], 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(WIDTHS[0])
        blocks = []
        cin = WIDTHS[0]
        for index, width in enumerate(WIDTHS):
            stride = 1 if index == 0 else 2
            blocks += [BasicBlock(cin, width, stride), BasicBlock(width, width, 1)]
            cin = width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.blocks(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def model() -> nn.Module:
    return ResNet18()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, 3, 32, 32, generator=torch.Generator().manual_seed(0)),)


def targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, CLASSES, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
