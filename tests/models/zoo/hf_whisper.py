"""HF transformers WhisperForConditionalGeneration, tiny, built from its config, LayerDrop 0.

Idioms: a convolutional audio front end (two ``Conv1d`` + GELU over ``input_features``), fixed
sinusoidal encoder positions, LayerDrop (``torch.rand([]) < self.layerdrop``, here 0) in encoder
and decoder, ``labels`` shifted right into ``decoder_input_ids`` by the model, the model's own
``loss``.
"""

import torch
from torch import nn
from transformers import WhisperConfig, WhisperForConditionalGeneration

VOCAB = 128
MELS = 8
FRAMES = 16  # the encoder halves it: 2 * max_source_positions
TARGET = 6


def model() -> nn.Module:
    config = WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=MELS, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=FRAMES // 2, max_target_positions=16, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, suppress_tokens=None,
        begin_suppress_tokens=None, attn_implementation="eager",
    )
    torch.manual_seed(0)
    return WhisperForConditionalGeneration(config).train()


def inputs(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    features = torch.randn(batch_size, MELS, FRAMES, generator=g)
    labels = torch.randint(3, VOCAB, (batch_size, TARGET), generator=g)
    return {"input_features": features, "labels": labels}
