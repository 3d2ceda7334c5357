"""Held-out fidelity model: HF transformers ConvNextForImageClassification (stages of depths [1, 1, 1, 1],
widths 32-64-128-256: depthwise 7×7 convolutions, channels-last LayerNorm, layer scale), built from its config
(no download), 3×32×32 inputs, 10 classes."""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import ConvNextConfig, ConvNextForImageClassification

IMAGE = 32
CLASSES = 10


def model() -> nn.Module:
    config = ConvNextConfig(num_channels=3, patch_size=2, num_stages=4, hidden_sizes=[32, 64, 128, 256],
                            depths=[1, 1, 1, 1], num_labels=CLASSES, image_size=IMAGE)
    torch.manual_seed(0)
    return ConvNextForImageClassification(config).train()


def inputs(batch_size: int) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.randn(batch_size, 3, IMAGE, IMAGE, generator=torch.Generator().manual_seed(0))}


def targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, CLASSES, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, targets)
