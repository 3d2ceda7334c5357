"""Held-out fidelity model: a small MobileNetV2-style CNN (inverted residuals: 1×1 expand, depthwise 3×3,
1×1 project, ReLU6, residual where shapes match) after a strided stem, 3×32×32 inputs, 10 classes."""

import torch
import torch.nn.functional as F
from torch import nn

CLASSES = 10


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int = 4) -> None:
        super().__init__()
        hidden = cin * expand
        self.block = nn.Sequential(
            nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(),
            nn.Conv2d(hidden, hidden, 3, stride=stride, padding=1, groups=hidden, bias=False), nn.BatchNorm2d(hidden),
            nn.ReLU6(), nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x)
        return x + out if self.residual else out


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU6(),
        InvertedResidual(32, 32, 1), InvertedResidual(32, 48, 2), InvertedResidual(48, 48, 1),
        InvertedResidual(48, 96, 2), InvertedResidual(96, 96, 1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(96, CLASSES))


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, 3, 32, 32, generator=torch.Generator().manual_seed(0)),)


def targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, CLASSES, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
