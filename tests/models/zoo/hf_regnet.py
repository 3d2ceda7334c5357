"""HF transformers RegNetForImageClassification, tiny, built from its config.

Idioms: grouped 3x3 convolutions, squeeze-and-excitation (``AdaptiveAvgPool2d`` then two 1x1
convolutions gating the input), a shortcut with a strided 1x1 convolution + BatchNorm,
BatchNorm running statistics, a flattened pooled head.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import RegNetConfig, RegNetForImageClassification

IMAGE = 32
CLASSES = 10


def model() -> nn.Module:
    config = RegNetConfig(
        num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8,
        layer_type="y", num_labels=CLASSES,
    )
    torch.manual_seed(0)
    return RegNetForImageClassification(config).train()


def inputs(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(batch_size, 3, IMAGE, IMAGE, generator=g)}


def targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, targets)
