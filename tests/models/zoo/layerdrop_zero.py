"""LayerDrop at probability 0, written as Bart and Whisper wrote it: ``if torch.rand([]) < self.layerdrop``.

Idioms: a draw that no traced tensor feeds (torch.fx runs it eagerly while tracing) and a branch
on it, inside a loop over an ``nn.ModuleList``. With probability 0 the branch never skips: the
tracer specialises it (the plan lists it, with file and line) and ``run --check`` verifies every
step that it still goes that way. Dropout 0.1 between the layers.
"""

import torch
import torch.nn.functional as F
from torch import nn

CLASSES = 4


class Encoder(nn.Module):
    def __init__(self, layerdrop: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.dropout = nn.Dropout(0.1)
        self.layerdrop = layerdrop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training:
                dropout_probability = torch.rand([])
                if dropout_probability < self.layerdrop:  # skip the layer
                    continue
            x = self.dropout(torch.relu(layer(x)))
        return x


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.encoder = Encoder(layerdrop=0.0)
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)))


def model() -> nn.Module:
    torch.manual_seed(0)
    return Net().train()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 8, generator=g),)


def targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
