"""Inception-v1 (GoogLeNet): nine inception blocks (3a-3b, 4a-4e, 5a-5b).

Each block has four parallel branches (1x1, 1x1->3x3, 1x1->5x5, 3x3 max
pool->1x1) whose outputs are concatenated along channels with ``torch.cat``.
Convolutions are conv + BatchNorm + ReLU (as in common reimplementations);
auxiliary classifiers and local response normalisation are omitted.

Input: images of shape ``[batch, 3, 224, 224]``; output: logits ``[batch, 1000]``.

Model-file convention (see ``examples/README.md``):
``model()`` builds the network, ``inputs(batch_size)`` returns a deterministic
synthetic batch, ``targets(batch_size)`` returns deterministic labels and
``loss(output, targets)`` returns a mean-reduced scalar loss.

Every operation is per-sample along dim 0 except BatchNorm, and the network
traces with ``torch.fx.symbolic_trace``.  Dropout defaults to ``p=0.0`` so
runs are deterministic (the original uses 0.4); the module stays in the graph.
"""

import torch
import torch.nn.functional as F
from torch import nn

IMAGE_SIZE = 224
NUM_CLASSES = 1000
DROPOUT = 0.0


class ConvBNReLU(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int,
                 stride: int = 1, padding: int = 0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride,
                              padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(out_channels, eps=0.001)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


class InceptionBlock(nn.Module):
    def __init__(self, in_channels: int, ch1x1: int, ch3x3red: int, ch3x3: int,
                 ch5x5red: int, ch5x5: int, pool_proj: int) -> None:
        super().__init__()
        self.branch1 = ConvBNReLU(in_channels, ch1x1, kernel_size=1)
        self.branch2 = nn.Sequential(
            ConvBNReLU(in_channels, ch3x3red, kernel_size=1),
            ConvBNReLU(ch3x3red, ch3x3, kernel_size=3, padding=1),
        )
        self.branch3 = nn.Sequential(
            ConvBNReLU(in_channels, ch5x5red, kernel_size=1),
            ConvBNReLU(ch5x5red, ch5x5, kernel_size=5, padding=2),
        )
        self.branch4 = nn.Sequential(
            nn.MaxPool2d(kernel_size=3, stride=1, padding=1),
            ConvBNReLU(in_channels, pool_proj, kernel_size=1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b1 = self.branch1(x)
        b2 = self.branch2(x)
        b3 = self.branch3(x)
        b4 = self.branch4(x)
        return torch.cat([b1, b2, b3, b4], 1)


class GoogLeNet(nn.Module):
    def __init__(self, num_classes: int = NUM_CLASSES, dropout: float = DROPOUT) -> None:
        super().__init__()
        self.conv1 = ConvBNReLU(3, 64, kernel_size=7, stride=2, padding=3)
        self.maxpool1 = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        self.conv2 = ConvBNReLU(64, 64, kernel_size=1)
        self.conv3 = ConvBNReLU(64, 192, kernel_size=3, padding=1)
        self.maxpool2 = nn.MaxPool2d(3, stride=2, ceil_mode=True)

        self.inception3a = InceptionBlock(192, 64, 96, 128, 16, 32, 32)
        self.inception3b = InceptionBlock(256, 128, 128, 192, 32, 96, 64)
        self.maxpool3 = nn.MaxPool2d(3, stride=2, ceil_mode=True)

        self.inception4a = InceptionBlock(480, 192, 96, 208, 16, 48, 64)
        self.inception4b = InceptionBlock(512, 160, 112, 224, 24, 64, 64)
        self.inception4c = InceptionBlock(512, 128, 128, 256, 24, 64, 64)
        self.inception4d = InceptionBlock(512, 112, 144, 288, 32, 64, 64)
        self.inception4e = InceptionBlock(528, 256, 160, 320, 32, 128, 128)
        self.maxpool4 = nn.MaxPool2d(2, stride=2, ceil_mode=True)

        self.inception5a = InceptionBlock(832, 256, 160, 320, 32, 128, 128)
        self.inception5b = InceptionBlock(832, 384, 192, 384, 48, 128, 128)

        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(1024, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool1(self.conv1(x))
        x = self.maxpool2(self.conv3(self.conv2(x)))
        x = self.inception3b(self.inception3a(x))
        x = self.maxpool3(x)
        x = self.inception4a(x)
        x = self.inception4b(x)
        x = self.inception4c(x)
        x = self.inception4d(x)
        x = self.inception4e(x)
        x = self.maxpool4(x)
        x = self.inception5b(self.inception5a(x))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(self.dropout(x))


def model() -> nn.Module:
    return GoogLeNet()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g),)


def targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, NUM_CLASSES, (batch_size,), generator=g)


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
