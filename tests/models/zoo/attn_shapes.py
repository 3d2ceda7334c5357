"""A hand-written causal-attention language model in the style of minGPT / nanoGPT.

Idioms: shape reads ``B, T, C = x.size()`` and ``b, t = idx.size()``,
``q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)``,
``y.transpose(1, 2).contiguous().view(B, T, C)``, positions built with
``torch.arange(0, t, ...)`` from a read length, the in-place mask
``att.masked_fill_(self.bias[:, :, :T, :T] == 0, float('-inf'))`` on a
sliced registered buffer, dropout 0.1 on the attention and the residual, a
tied embedding / LM head (``self.head.weight = self.tok.weight``), int64
token inputs, an ``nn.ModuleDict`` MLP called by key, and a loss over ``logits.view(-1, V)``.

``[B, 16]`` int64 -> logits ``[B, 16, 128]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 128
BLOCK = 32  # the causal-mask buffer; inputs are shorter and it is sliced
TOKENS = 16
EMBD = 32
HEADS = 2
LAYERS = 2
DROPOUT = 0.1


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        assert EMBD % HEADS == 0
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(EMBD, 3 * EMBD)
        # output projection
        self.c_proj = nn.Linear(EMBD, EMBD)
        # regularization
        self.attn_dropout = nn.Dropout(DROPOUT)
        self.resid_dropout = nn.Dropout(DROPOUT)
        self.n_head = HEADS
        self.n_embd = EMBD
        # causal mask to ensure that attention is only applied to the left in the input sequence
        self.register_buffer("bias", torch.tril(torch.ones(BLOCK, BLOCK)).view(1, 1, BLOCK, BLOCK))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # batch size, sequence length, embedding dimensionality (n_embd)

        # calculate query, key, values for all heads in batch and move head forward to be the batch dim
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)

        # causal self-attention; Self-attend: (B, nh, T, hs) x (B, nh, hs, T) -> (B, nh, T, T)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att.masked_fill_(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_dropout(att)
        y = att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side

        # output projection
        y = self.resid_dropout(self.c_proj(y))
        return y


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(EMBD)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(EMBD)
        self.mlp = nn.ModuleDict(dict(
            c_fc=nn.Linear(EMBD, 4 * EMBD),
            c_proj=nn.Linear(4 * EMBD, EMBD),
            act=nn.GELU(),
            dropout=nn.Dropout(DROPOUT),
        ))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.mlp
        x = x + self.attn(self.ln_1(x))
        x = x + m.dropout(m.c_proj(m.act(m.c_fc(self.ln_2(x)))))
        return x


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, EMBD)
        self.pos = nn.Embedding(BLOCK, EMBD)
        self.drop = nn.Dropout(DROPOUT)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(EMBD)
        self.head = nn.Linear(EMBD, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # weight tying
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        device = idx.device
        b, t = idx.size()
        assert t <= BLOCK, f"Cannot forward sequence of length {t}, block size is only {BLOCK}"
        pos = torch.arange(0, t, dtype=torch.long, device=device).unsqueeze(0)  # shape (1, t)

        tok_emb = self.tok(idx)  # token embeddings of shape (b, t, n_embd)
        pos_emb = self.pos(pos)  # position embeddings of shape (1, t, n_embd)
        x = self.drop(tok_emb + pos_emb)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        logits = self.head(x)
        return logits


def model() -> nn.Module:
    torch.manual_seed(0)
    return GPT()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, VOCAB, (batch_size, TOKENS), generator=g),)


def targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (batch_size, TOKENS), generator=g)


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = output
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
