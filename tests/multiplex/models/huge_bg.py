"""A background model far larger than any machine's memory (never built for real: refused up front)."""

import torch
from torch import nn


def model() -> nn.Module:
    return nn.Linear(400_000, 400_000)


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, 400_000),)
