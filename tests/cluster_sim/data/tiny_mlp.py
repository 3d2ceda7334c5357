"""A tiny model for fast simulator tests: cheap to trace, plan and solve."""

import torch
from torch import nn


def model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 16)
    )


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 64, generator=generator),)
