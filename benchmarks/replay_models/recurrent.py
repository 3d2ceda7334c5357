"""Replay model for sequence workloads (Pollux's bert, deepspeech2): an embedding, a two-layer LSTM, a classifier.

Token ids ``[B, 32]`` below 1000, width 128, the classifier on the last step's output. Few layers on purpose:
the executor's cost per layer is large on busy CPU cores, so a model of many small layers would replay its
overheads, not its work. Self-contained (the coordinator stages a model file alone).
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, LENGTH, WIDTH, CLASSES = 1000, 32, 128, 10


class Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.lstm = nn.LSTM(WIDTH, WIDTH, num_layers=2, batch_first=True)
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        output, _ = self.lstm(self.embed(tokens))
        return self.head(output[:, -1])


def model() -> nn.Module:
    return Recurrent()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, VOCAB, (batch_size, LENGTH), generator=torch.Generator().manual_seed(0)),)


def targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, CLASSES, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
