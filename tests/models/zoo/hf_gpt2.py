"""HF transformers GPT2LMHeadModel, tiny, built from its config (no download).

Idioms: dict keyword inputs (``input_ids``, ``labels``), a ``ModelOutput``
(``CausalLMOutputWithCrossAttentions``) with the model's own ``loss`` computed
from ``labels`` (shifted inside the model), tied embeddings (``lm_head.weight``
is ``transformer.wte.weight``), dropout 0.1 everywhere, train mode, HF's
shape reads and ``view`` calls inside attention.

No ``loss()``: the default takes ``output.loss``.
"""

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 128
TOKENS = 16


def model() -> nn.Module:
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, tie_word_embeddings=True,
        bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).train()


def inputs(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (batch_size, TOKENS), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}
