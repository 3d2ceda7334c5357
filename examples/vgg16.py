"""VGG-16 (configuration "D", no batch norm) for ImageNet-style classification.

Input: images of shape ``[batch, 3, 224, 224]``; output: logits ``[batch, 1000]``.

Model-file convention (see ``examples/README.md``):
``model()`` builds the network, ``inputs(batch_size)`` returns a deterministic
synthetic batch, ``targets(batch_size)`` returns deterministic labels and
``loss(output, targets)`` returns a mean-reduced scalar loss.

Every operation is per-sample along dim 0, and the network traces with
``torch.fx.symbolic_trace``.  Dropout defaults to ``p=0.0`` so runs are
deterministic (the original uses 0.5); the modules are still in the graph.
"""

import torch
import torch.nn.functional as F
from torch import nn

IMAGE_SIZE = 224
NUM_CLASSES = 1000
DROPOUT = 0.0

# Output channels per conv layer; "M" is a 2x2 max pool.
VGG16_CFG: tuple[int | str, ...] = (
    64, 64, "M",
    128, 128, "M",
    256, 256, 256, "M",
    512, 512, 512, "M",
    512, 512, 512, "M",
)


class VGG16(nn.Module):
    def __init__(self, num_classes: int = NUM_CLASSES, dropout: float = DROPOUT) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        in_channels = 3
        for v in VGG16_CFG:
            if v == "M":
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                assert isinstance(v, int)
                layers.append(nn.Conv2d(in_channels, v, kernel_size=3, padding=1))
                layers.append(nn.ReLU())
                in_channels = v
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def model() -> nn.Module:
    return VGG16()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g),)


def targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, NUM_CLASSES, (batch_size,), generator=g)


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
