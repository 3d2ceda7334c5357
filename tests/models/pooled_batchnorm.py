"""A head that pools to 1x1 and then normalises the batch (as Inception's auxiliary head does): the
BatchNorm sees one value per channel per sample, so it cannot train on one sample alone (torch raises
"Expected more than 1 value per channel when training"), though it trains on any batch of two or more."""

import torch
from torch import nn


class PooledHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, kernel_size=3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d((1, 1))
        self.norm = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(torch.relu(self.norm(self.pool(self.conv(x)))), 1))


def model() -> nn.Module:
    torch.manual_seed(0)
    return PooledHead()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, 3, 6, 6, generator=torch.Generator().manual_seed(0)),)
