"""HF transformers ConvNextForImageClassification, tiny, built from its config.

Idioms: a patchify stem (strided conv + channels-first LayerNorm), depthwise 7x7 convolutions,
``permute`` to channels-last for LayerNorm and the pointwise MLP and back, layer scale
(a per-channel parameter multiplying the branch), drop path 0, a pooled LayerNorm head.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import ConvNextConfig, ConvNextForImageClassification

IMAGE = 32
CLASSES = 10


def model() -> nn.Module:
    config = ConvNextConfig(
        num_channels=3, patch_size=4, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=CLASSES,
        image_size=IMAGE,
    )
    torch.manual_seed(0)
    return ConvNextForImageClassification(config).train()


def inputs(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(batch_size, 3, IMAGE, IMAGE, generator=g)}


def targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, targets)
