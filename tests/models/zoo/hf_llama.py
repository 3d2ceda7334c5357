"""HF transformers LlamaForCausalLM, tiny, built from its config (no download).

Idioms: rotary position embeddings computed under ``torch.autocast(device_type=x.device.type,
enabled=False)`` (on the meta device that autocast raises: the planner traces on CPU tensors),
RMSNorm, grouped-query attention (2 heads, 1 key/value head), SwiGLU MLP, a causal mask built from
shapes, SDPA, untied ``lm_head``, the model's own ``loss`` from ``labels``.
"""

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 128
TOKENS = 16


def model() -> nn.Module:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def inputs(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch_size, TOKENS), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}
