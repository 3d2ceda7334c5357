"""A model whose plan on 2 GPUs under a GPU-time amplification cap of 1.5 is burst-parallel.

The convolutions have much compute and few parameters: they split over both
GPUs within the cap. The linear head has many parameters and little compute:
on two GPUs its time would not halve, so the cap keeps it on one, and the
other GPU is idle while it runs: a window for a background job
(``--device-model a100 --batch 64 --amplification 1.5``).
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
