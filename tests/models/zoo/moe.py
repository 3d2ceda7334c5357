"""A mixture-of-experts language model with top-2 routing, Mixtral's way.

Idioms: a gate scores every token, ``topk`` picks two experts per token, each expert finds its tokens
with ``nonzero`` (skipping itself when it has none) and adds its weighted output back with
``index_add_``. The shapes inside the block follow the data, so neither torch.fx nor torch.export can
trace it: each block becomes one opaque layer run eagerly. Routing is per token, so a rank's tokens
route as they would in one process.
"""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64
SEQ = 6
DIM = 16


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))


class SparseMoE(nn.Module):
    def __init__(self, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(DIM, experts, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(experts))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        tokens = hidden.reshape(-1, hidden.shape[-1])
        scores = torch.softmax(self.gate(tokens), dim=-1)
        weights, chosen = torch.topk(scores, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            token, slot = torch.nonzero(chosen == index, as_tuple=True)
            if token.numel() == 0:
                continue
            out.index_add_(0, token, expert(tokens[token]) * weights[token, slot].unsqueeze(-1))
        return out.reshape(hidden.shape)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.moe = SparseMoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class MoELM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def model() -> nn.Module:
    torch.manual_seed(0)
    return MoELM().train()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, VOCAB, (batch_size, SEQ), generator=g),)


def targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), targets.flatten())
