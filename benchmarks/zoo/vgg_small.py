"""Held-out fidelity model: a small VGG-style CNN (two 3×3 conv-BN-ReLU per stage, max-pooling between, widths
16-32-64, a two-layer classifier with dropout 0), 3×32×32 inputs, 10 classes."""

import torch
import torch.nn.functional as F
from torch import nn

CLASSES = 10


def _stage(cin: int, cout: int) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2)]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*_stage(3, 16), *_stage(16, 32), *_stage(32, 64), nn.Flatten(),
                         nn.Linear(64 * 4 * 4, 256), nn.ReLU(), nn.Linear(256, CLASSES))


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, 3, 32, 32, generator=torch.Generator().manual_seed(0)),)


def targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, CLASSES, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
