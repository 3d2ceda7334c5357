"""A classifier that pools each sample over its own length with a Python loop over the lengths' values.

Idioms: ``lengths.tolist()`` and a list comprehension slicing ``x[i, :n]`` per sample, then
``torch.stack``: eager-only code inside a module (fx cannot iterate a traced value, export cannot
guard on one), so the pooling module becomes one opaque layer; each sample's output depends on that
sample alone. Dropout 0.1 before the head.
"""

import torch
import torch.nn.functional as F
from torch import nn

SEQ = 7
DIM = 12
CLASSES = 3


class LengthPool(nn.Module):
    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return torch.stack([x[i, :n].mean(dim=0) for i, n in enumerate(lengths.tolist())])


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Linear(DIM, DIM)
        self.pool = LengthPool()
        self.dropout = nn.Dropout(0.1)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.head(self.dropout(self.pool(torch.tanh(self.encode(x)), lengths)))


def model() -> nn.Module:
    torch.manual_seed(0)
    return Net().train()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, SEQ, DIM, generator=g), torch.randint(1, SEQ + 1, (batch_size,), generator=g)


def targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
