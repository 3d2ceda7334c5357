"""HF transformers ViTForImageClassification, tiny, built from its config.

Idioms: ``pixel_values`` keyword input, patch embedding by a strided conv then
``flatten(2).transpose(1, 2)``, a CLS token ``expand``-ed over the batch read
from the input's shape, position embeddings, dropout 0.1, an
``ImageClassifierOutput`` read through ``output.logits``, train mode.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import ViTConfig, ViTForImageClassification

IMAGE = 16
CLASSES = 10


def model() -> nn.Module:
    config = ViTConfig(
        image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, num_labels=CLASSES,
        hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
    )
    torch.manual_seed(0)
    return ViTForImageClassification(config).train()


def inputs(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(batch_size, 3, IMAGE, IMAGE, generator=g)}


def targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, targets)
