"""HF transformers T5ForConditionalGeneration, tiny, built from its config.

Idioms: an encoder-decoder with two token inputs (``input_ids`` and
``labels``; the model shifts ``labels`` right into ``decoder_input_ids``
itself), relative position bias computed from shape reads and shared between
layers, tied input embeddings shared by encoder and decoder, T5's RMS
LayerNorm, dropout 0.1, a ``Seq2SeqLMOutput`` with the model's own ``loss``.

No ``loss()``: the default takes ``output.loss``.
"""

import torch
from torch import nn
from transformers import T5Config, T5ForConditionalGeneration

VOCAB = 128
SOURCE = 12
TARGET = 8


def model() -> nn.Module:
    config = T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.1,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    torch.manual_seed(0)
    return T5ForConditionalGeneration(config).train()


def inputs(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    source = torch.randint(2, VOCAB, (batch_size, SOURCE), generator=g)
    labels = torch.randint(2, VOCAB, (batch_size, TARGET), generator=g)
    return {"input_ids": source, "labels": labels}
