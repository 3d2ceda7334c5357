"""Held-out fidelity model: HF transformers ResNetForImageClassification (basic blocks [1, 1, 1, 1], widths
32-64-128-256), built from its config (no download), CIFAR-sized 3×32×32 inputs, 10 classes."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import ResNetConfig, ResNetForImageClassification

IMAGE = 32
CLASSES = 10


def model() -> nn.Module:
    config = ResNetConfig(num_channels=3, embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1],
                          layer_type="basic", num_labels=CLASSES)
    torch.manual_seed(0)
    return ResNetForImageClassification(config).train()


def inputs(batch_size: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(batch_size, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(0))}


def targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, CLASSES, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, targets)
