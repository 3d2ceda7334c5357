"""A model file whose inputs() returns a bare tensor (the one positional argument), not a tuple."""

import torch
from torch import nn


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def inputs(batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, 8, generator=torch.Generator().manual_seed(0))
