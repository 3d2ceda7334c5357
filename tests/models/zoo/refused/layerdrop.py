"""Refused: LayerDrop above 0, written as Bart and Whisper write it (``if torch.rand([]) < p: continue``).

Which layers run changes from step to step with a random draw, so no one layer graph is the
model. ``deeppool plan`` must refuse it with one line naming this file and line and saying to set
the probability to 0 or wrap the branch.
"""

import torch
from torch import nn


class Encoder(nn.Module):
    def __init__(self, layerdrop: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.layerdrop = layerdrop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training:
                if torch.rand([]) < self.layerdrop:
                    continue
            x = torch.relu(layer(x))
        return x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = Encoder(layerdrop=0.1)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x))


def model() -> nn.Module:
    torch.manual_seed(0)
    return Net().train()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 16, generator=g),)
