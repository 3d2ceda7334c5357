"""Refused: a contrastive loss over the batch, as CLIP's.

Each text is scored against every image of the batch (a batch-by-batch matrix) and its label is its own
index (``arange(len(batch))``): a sample's loss depends on the others, and torch.export finds the batch
size made a constant. ``deeppool plan`` must refuse it with one line saying so.
"""

import torch
import torch.nn.functional as F
from torch import nn


class TwoTowers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.text = nn.Linear(8, 16)
        self.image = nn.Linear(12, 16)

    def forward(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        logits = F.normalize(self.text(text), dim=-1) @ F.normalize(self.image(image), dim=-1).t()
        labels = torch.arange(len(text))
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def model() -> nn.Module:
    return TwoTowers()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, 8, generator=g), torch.randn(batch_size, 12, generator=g)
