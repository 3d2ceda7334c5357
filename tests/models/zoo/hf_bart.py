"""HF transformers BartForConditionalGeneration, tiny, built from its config, LayerDrop 0.

Idioms: LayerDrop written as ``if self.training: if torch.rand([]) < self.layerdrop: continue`` in
both encoder and decoder (a branch on a random value: fx and torch.export refuse it, the
real-tensor tracer specialises it and ``run --check`` verifies it), ``labels`` shifted right
into ``decoder_input_ids`` by the model (``shifted[:, 0] = decoder_start_token_id``), learned
positions with an offset, tied embeddings, dropout 0.1, the model's own ``loss``.
"""

import torch
from torch import nn
from transformers import BartConfig, BartForConditionalGeneration

VOCAB = 128
SOURCE = 12
TARGET = 8


def model() -> nn.Module:
    config = BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        dropout=0.1, encoder_layerdrop=0.0, decoder_layerdrop=0.0, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None, attn_implementation="eager",
    )
    torch.manual_seed(0)
    return BartForConditionalGeneration(config).train()


def inputs(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    source = torch.randint(3, VOCAB, (batch_size, SOURCE), generator=g)
    labels = torch.randint(3, VOCAB, (batch_size, TARGET), generator=g)
    return {"input_ids": source, "labels": labels}
