"""Fidelity model: a plain CNN (conv-BN-ReLU, strided), 3×32×32 inputs, 10 classes."""

import torch
import torch.nn.functional as F
from torch import nn


def _block(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


def model() -> nn.Module:
    return nn.Sequential(
        _block(3, 32, 1), _block(32, 64, 2), _block(64, 128, 2), _block(128, 128, 1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 512), nn.ReLU(), nn.Linear(512, 10),
    )


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, 3, 32, 32, generator=torch.Generator().manual_seed(0)),)


def targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, 10, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
