"""A background model whose forward changes state: batch-norm statistics and dropout's draws from the RNG."""

import torch
import torch.nn.functional as F
from torch import nn


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, 16),)


def targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, 4, (batch_size,))


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
