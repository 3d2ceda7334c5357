"""A model whose plan on 2 GPUs is burst-parallel: convolutions scale, a wide linear head does not.

The convolutions have much compute and few parameters, so they split over
both GPUs; the head has many parameters and little compute, so its gradient
all-reduce costs more than splitting saves, and it runs on one GPU while the
other is idle: a window for a background job.
"""

import torch
from torch import nn

SIDE, WIDTH = 32, 16


def model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, WIDTH, 3, padding=1), nn.ReLU(), nn.Conv2d(WIDTH, WIDTH, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(8), nn.Flatten(), nn.Linear(WIDTH * 64, 2048), nn.ReLU(), nn.Linear(2048, 2048),
        nn.ReLU(), nn.Linear(2048, 10),
    )


def inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 3, SIDE, SIDE),)
