"""A small DLRM-style recommendation model (Naumov et al., 2019): the case where data parallel scales badly.

Inputs: dense features ``[batch, 13]`` (float) and one categorical id per
table ``[batch, 4]`` (int64); output: a click logit ``[batch]``.

A bottom MLP embeds the dense features; each of ``TABLES`` embedding tables
(``ROWS`` rows of ``DIM``) embeds one categorical feature; the pairwise dot
products of those ``TABLES + 1`` vectors (the feature interaction) and the
dense vector feed a top MLP. The tables hold nearly all the parameters and
nearly none of the compute: under data parallel every rank all-reduces every
table's (dense) gradient each iteration, so adding GPUs adds communication
and saves little time. That is where a burst plan gives the tables fewer GPUs
than the MLPs, or gives the job fewer GPUs and lends the rest.

Model-file convention (see ``examples/README.md``); every operation is
per-sample along dim 0, and the network traces with ``torch.fx.symbolic_trace``.

    deeppool plan examples/dlrm.py --gpus 2 --batch 256 --objective cluster   # measured on this machine
    deeppool run dlrm-plan.json --background examples/background_mlp.py
"""

import torch
import torch.nn.functional as F
from torch import nn

DENSE, TABLES, ROWS, DIM = 13, 4, 50_000, 32
BOTTOM, TOP = (64, DIM), (128, 64, 1)


def mlp(sizes: tuple[int, ...], features: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for size in sizes:
        layers += [nn.Linear(features, size), nn.ReLU()]
        features = size
    return nn.Sequential(*layers[:-1])


class Dlrm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bottom = mlp(BOTTOM, DENSE)
        self.tables = nn.ModuleList(nn.Embedding(ROWS, DIM) for _ in range(TABLES))
        pairs = (TABLES + 1) * TABLES // 2
        self.top = mlp(TOP, DIM + pairs)
        rows, cols = torch.triu_indices(TABLES + 1, TABLES + 1, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bottom(dense))  # [batch, DIM]
        vectors = torch.stack([x, *(table(ids[:, i]) for i, table in enumerate(self.tables))], dim=1)
        dots = torch.bmm(vectors, vectors.transpose(1, 2))  # [batch, TABLES + 1, TABLES + 1]
        pairs = dots[:, self.rows, self.cols]
        return self.top(torch.cat([x, pairs], dim=1)).squeeze(1)


def model() -> nn.Module:
    torch.manual_seed(0)
    return Dlrm()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch_size, DENSE, generator=g), torch.randint(0, ROWS, (batch_size, TABLES), generator=g)


def targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, 2, (batch_size,), generator=torch.Generator().manual_seed(1)).float()


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(output, targets)
