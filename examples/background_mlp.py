"""A small background job: an MLP learning a fixed teacher's labels (its loss falls within tens of steps).

    deeppool run plan.json --background examples/background_mlp.py --bg-batch 8 --mux gate
"""

import torch
import torch.nn.functional as F
from torch import nn

FEATURES, HIDDEN, CLASSES, POOL = 64, 256, 8, 512


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                         nn.Linear(HIDDEN, CLASSES))


def _pool() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(POOL, FEATURES, generator=g)
    teacher = torch.randn(FEATURES, CLASSES, generator=g)
    return x, (x @ teacher).argmax(dim=1)


def _rows(batch_size: int) -> torch.Tensor:
    """A batch of rows from a fixed pool, drawn with the torch RNG (the background job seeds it per step)."""
    return torch.randint(0, POOL, (batch_size,))


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (_pool()[0][_rows(batch_size)],)


def targets(batch_size: int) -> torch.Tensor:
    return _pool()[1][_rows(batch_size)]


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
