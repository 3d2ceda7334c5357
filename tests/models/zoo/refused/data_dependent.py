"""Refused: control flow on tensor values (``if x.sum() > 0``) inside a module.

The branch taken depends on the data, and on which samples a rank holds, so
neither a traced graph nor a split batch can reproduce it. ``deeppool plan``
must refuse it with one line naming the module ``gate``.
"""

import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 16)
        self.down = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.up(x)
        else:
            return self.down(x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.act = nn.ReLU(inplace=True)
        self.gate = Gate()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(self.act(self.fc(x))))


def model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 8, generator=g),)
