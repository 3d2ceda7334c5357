"""HF transformers GPTNeoXForCausalLM, tiny, built from its config (no download).

Idioms: partial rotary embeddings (``rotary_pct`` 0.5) under ``torch.autocast(..., enabled=False)``,
the parallel residual (attention and MLP read the same input), a fused query-key-value projection
split by ``view``/``chunk``, dropout 0.1, the model's own ``loss`` from ``labels``.
"""

import torch
from torch import nn
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

VOCAB = 128
TOKENS = 16


def model() -> nn.Module:
    config = GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=32, rotary_pct=0.5, hidden_dropout=0.1, attention_dropout=0.1,
        use_parallel_residual=True, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return GPTNeoXForCausalLM(config).train()


def inputs(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch_size, TOKENS), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}
