"""Held-out fidelity model: HF transformers BertForSequenceClassification (4 layers, hidden 128, 4 heads,
32 tokens with an attention mask, two segments), built from its config (no download), 4 classes, dropout 0."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig, BertForSequenceClassification

VOCAB = 1000
TOKENS = 32
CLASSES = 4


def model() -> nn.Module:
    config = BertConfig(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=256, max_position_embeddings=TOKENS, type_vocab_size=2,
                        num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return BertForSequenceClassification(config).train()


def inputs(batch_size: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, VOCAB, (batch_size, TOKENS), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(batch_size, TOKENS, dtype=torch.long)
    segments = torch.zeros(batch_size, TOKENS, dtype=torch.long)
    segments[:, TOKENS // 2:] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": segments}


def targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, CLASSES, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, targets)
