"""ResNet-50 (Bottleneck blocks [3, 4, 6, 3], BatchNorm2d, stride on the 3x3 conv).

Input: images of shape ``[batch, 3, 224, 224]``; output: logits ``[batch, 1000]``.

Model-file convention (see ``examples/README.md``):
``model()`` builds the network, ``inputs(batch_size)`` returns a deterministic
synthetic batch, ``targets(batch_size)`` returns deterministic labels and
``loss(output, targets)`` returns a mean-reduced scalar loss.

Every operation is per-sample along dim 0 except BatchNorm, and the network
traces with ``torch.fx.symbolic_trace``.
"""

import torch
import torch.nn.functional as F
from torch import nn

IMAGE_SIZE = 224
NUM_CLASSES = 1000
LAYERS = (3, 4, 6, 3)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, kernel_size=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, kernel_size=3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, kernel_size=1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU()
        self.downsample: nn.Module | None = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet50(nn.Module):
    def __init__(self, layers: tuple[int, ...] = LAYERS, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        in_channels = 64
        stages: list[nn.Module] = []
        for i, (blocks, width) in enumerate(zip(layers, (64, 128, 256, 512))):
            stride = 1 if i == 0 else 2
            stage: list[nn.Module] = []
            for b in range(blocks):
                stage.append(Bottleneck(in_channels, width, stride if b == 0 else 1))
                in_channels = width * Bottleneck.expansion
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def model() -> nn.Module:
    return ResNet50()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g),)


def targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, NUM_CLASSES, (batch_size,), generator=g)


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
