"""A small CNN held out from the executor's tests: two conv blocks with BatchNorm (no conv bias before it: its
gradient is ~0, and Adam would step on round-off), a residual add, a head."""

import torch
from torch import nn


class SmallCnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.down = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images)
        x = x + self.block(x)
        x = torch.relu(self.down(x))
        return self.head(x.mean(dim=(2, 3)))


def model() -> nn.Module:
    return SmallCnn()


def inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 3, 8, 8, generator=torch.Generator().manual_seed(1)),)


def targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, 10, (batch_size,), generator=torch.Generator().manual_seed(2))


def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target)
