"""HF transformers BertForSequenceClassification, tiny, built from its config.

Idioms: dict keyword inputs with an ``attention_mask`` (a deterministic
padding pattern, the same number of real tokens in every row) and
``token_type_ids`` (two segments), the extended-mask arithmetic HF does on
the mask, a ``SequenceClassifierOutput`` read through ``output.logits``,
dropout 0.1, pooler + classifier head, train mode.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import BertConfig, BertForSequenceClassification

VOCAB = 128
TOKENS = 16
PADDED = 4  # the last PADDED tokens of every row are padding
CLASSES = 3


def model() -> nn.Module:
    config = BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, type_vocab_size=2, num_labels=CLASSES,
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
    )
    torch.manual_seed(0)
    return BertForSequenceClassification(config).train()


def inputs(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (batch_size, TOKENS), generator=g)
    mask = torch.ones(batch_size, TOKENS, dtype=torch.long)
    mask[:, TOKENS - PADDED:] = 0
    ids = ids * mask  # padding token id 0
    segments = torch.zeros(batch_size, TOKENS, dtype=torch.long)
    segments[:, TOKENS // 2:] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": segments}


def targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, targets)
