"""A deep Inception-style conv-BN-ReLU net, small and fast, whose fp32 training is chaotic.

Six blocks of three conv-BN-ReLU branches joined by torch.cat: a one-ulp change
in a normalised activation flips ReLUs downstream. Free-running fp32 training
for 4 steps (lr 0.1, momentum 0.9) on 3 ranks differed from single-process
training by 6e-3 (relative) on the development machine, which is why `--check`
compares step by step (deeppool/executor/training/reference.py).
"""

import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 8
BLOCKS = 6
SIZE = 16


class ConvBN(nn.Module):
    def __init__(self, cin: int, cout: int, k: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, padding=k // 2, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=1e-3)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


class Block(nn.Module):
    def __init__(self, cin: int, c: int) -> None:
        super().__init__()
        self.b1 = ConvBN(cin, c, 1)
        self.b2 = nn.Sequential(ConvBN(cin, c, 1), ConvBN(c, c, 3))
        self.b3 = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), ConvBN(cin, c, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.b1(x), self.b2(x), self.b3(x)], 1)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = ConvBN(3, 3 * WIDTH, 3)
        self.blocks = nn.Sequential(*[Block(3 * WIDTH, WIDTH) for _ in range(BLOCKS)])
        self.fc = nn.Linear(3 * WIDTH, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))


def model() -> nn.Module:
    return Net()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, SIZE, SIZE, generator=g),)


def targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 10, (batch_size,), generator=g)


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
