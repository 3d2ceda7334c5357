"""``x.squeeze()`` drops the batch dimension of a batch of one, so the ``cat`` on dim 1 after it fails at batch 1
(as it does eagerly) and runs at any larger batch: an op that no per-GPU batch of 1 can run."""

import torch
from torch import nn


class Squeezed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.fc(x).squeeze()
        return self.head(torch.cat((x[:, :7], gate.unsqueeze(1)), 1))


def model() -> nn.Module:
    torch.manual_seed(0)
    return Squeezed()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(batch_size, 8, generator=torch.Generator().manual_seed(0)),)
