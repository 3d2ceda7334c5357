"""Held-out fidelity model: HF transformers ViTForImageClassification (4 layers, hidden 64, 4 heads, 4×4
patches of 3×32×32 images: 65 tokens), built from its config (no download), 10 classes, dropout 0."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import ViTConfig, ViTForImageClassification

IMAGE = 32
CLASSES = 10


def model() -> nn.Module:
    config = ViTConfig(image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=4,
                       num_attention_heads=4, intermediate_size=256, num_labels=CLASSES,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return ViTForImageClassification(config).train()


def inputs(batch_size: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(batch_size, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(0))}


def targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, CLASSES, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, targets)
