"""HF transformers SwinForImageClassification, tiny, built from its config.

Idioms: windowed attention with ``view``/``permute`` window partition and reverse, a shifted
window (``torch.roll``) with an attention mask built from shapes, relative position bias indexed
from a buffer, patch merging (strided slicing and ``cat``), padding to a window multiple.
"""

import torch
import torch.nn.functional as F
from torch import nn
from transformers import SwinConfig, SwinForImageClassification

IMAGE = 32
CLASSES = 10


def model() -> nn.Module:
    config = SwinConfig(
        image_size=IMAGE, patch_size=4, num_channels=3, embed_dim=16, depths=[2, 1], num_heads=[2, 2],
        window_size=4, mlp_ratio=2.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        drop_path_rate=0.0, num_labels=CLASSES,
    )
    torch.manual_seed(0)
    return SwinForImageClassification(config).train()


def inputs(batch_size: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"pixel_values": torch.randn(batch_size, 3, IMAGE, IMAGE, generator=g)}


def targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, targets)
