"""A small Inception-v3-style net written the way torchvision writes ``inception.py`` (no import).

Idioms: ``BasicConv2d`` (conv + BN + ``F.relu(x, inplace=True)``), Inception
blocks whose branches are joined by ``torch.cat(outputs, 1)`` over a Python
list built in ``_forward``, functional pooling (``F.avg_pool2d``,
``F.max_pool2d``), ``_transform_input`` (per-channel ``torch.unsqueeze(x[:,
0], 1)`` arithmetic), an auxiliary head (``aux_logits=True``) that runs only
``if self.training``, a shape read (``x.view(x.size(0), -1)`` in the aux head), dropout before the classifier, and
the namedtuple ``InceptionOutputs(logits, aux_logits)`` returned in training
(a plain tensor in eval), as torchvision's ``eager_outputs`` does.

``[B, 3, 32, 32]`` -> ``InceptionOutputs([B, 10], [B, 10])``; loss =
CE(logits) + 0.4 * CE(aux_logits), the weighting of torchvision's reference
training script.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CLASSES = 10

InceptionOutputs = namedtuple("InceptionOutputs", ["logits", "aux_logits"])


class BasicConv2d(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, **kwargs: Any) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, bias=False, **kwargs)
        self.bn = nn.BatchNorm2d(out_channels, eps=0.001)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv(x)
        x = self.bn(x)
        return F.relu(x, inplace=True)


class InceptionA(nn.Module):
    def __init__(self, in_channels: int, pool_features: int) -> None:
        super().__init__()
        self.branch1x1 = BasicConv2d(in_channels, 8, kernel_size=1)

        self.branch5x5_1 = BasicConv2d(in_channels, 6, kernel_size=1)
        self.branch5x5_2 = BasicConv2d(6, 8, kernel_size=5, padding=2)

        self.branch3x3dbl_1 = BasicConv2d(in_channels, 8, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(8, 12, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(12, 12, kernel_size=3, padding=1)

        self.branch_pool = BasicConv2d(in_channels, pool_features, kernel_size=1)

    def _forward(self, x: Tensor) -> list[Tensor]:
        branch1x1 = self.branch1x1(x)

        branch5x5 = self.branch5x5_1(x)
        branch5x5 = self.branch5x5_2(branch5x5)

        branch3x3dbl = self.branch3x3dbl_1(x)
        branch3x3dbl = self.branch3x3dbl_2(branch3x3dbl)
        branch3x3dbl = self.branch3x3dbl_3(branch3x3dbl)

        branch_pool = F.avg_pool2d(x, kernel_size=3, stride=1, padding=1)
        branch_pool = self.branch_pool(branch_pool)

        outputs = [branch1x1, branch5x5, branch3x3dbl, branch_pool]
        return outputs

    def forward(self, x: Tensor) -> Tensor:
        outputs = self._forward(x)
        return torch.cat(outputs, 1)


class InceptionB(nn.Module):
    def __init__(self, in_channels: int) -> None:
        super().__init__()
        self.branch3x3 = BasicConv2d(in_channels, 24, kernel_size=3, stride=2)

        self.branch3x3dbl_1 = BasicConv2d(in_channels, 8, kernel_size=1)
        self.branch3x3dbl_2 = BasicConv2d(8, 12, kernel_size=3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(12, 12, kernel_size=3, stride=2)

    def _forward(self, x: Tensor) -> list[Tensor]:
        branch3x3 = self.branch3x3(x)

        branch3x3dbl = self.branch3x3dbl_1(x)
        branch3x3dbl = self.branch3x3dbl_2(branch3x3dbl)
        branch3x3dbl = self.branch3x3dbl_3(branch3x3dbl)

        branch_pool = F.max_pool2d(x, kernel_size=3, stride=2)

        outputs = [branch3x3, branch3x3dbl, branch_pool]
        return outputs

    def forward(self, x: Tensor) -> Tensor:
        outputs = self._forward(x)
        return torch.cat(outputs, 1)


class InceptionAux(nn.Module):
    def __init__(self, in_channels: int, num_classes: int) -> None:
        super().__init__()
        self.conv0 = BasicConv2d(in_channels, 16, kernel_size=1)
        self.conv1 = BasicConv2d(16, 32, kernel_size=3)
        self.conv1.stddev = 0.01  # type: ignore[assignment]
        self.fc = nn.Linear(32, num_classes)
        self.fc.stddev = 0.001  # type: ignore[assignment]

    def forward(self, x: Tensor) -> Tensor:
        # N x 36 x 7 x 7
        x = F.avg_pool2d(x, kernel_size=3, stride=2)
        # N x 36 x 3 x 3
        x = self.conv0(x)
        # N x 16 x 3 x 3
        x = self.conv1(x)
        # N x 32 x 1 x 1
        x = F.adaptive_avg_pool2d(x, (1, 1))
        # N x 32 x 1 x 1
        x = x.view(x.size(0), -1)
        # N x 32
        x = self.fc(x)
        # N x num_classes
        return x


class Inception3(nn.Module):
    def __init__(self, num_classes: int = 1000, aux_logits: bool = True, transform_input: bool = True,
                 dropout: float = 0.5) -> None:
        super().__init__()
        self.aux_logits = aux_logits
        self.transform_input = transform_input
        self.Conv2d_1a_3x3 = BasicConv2d(3, 8, kernel_size=3, stride=2, padding=1)
        self.Conv2d_2a_3x3 = BasicConv2d(8, 16, kernel_size=3, padding=1)
        self.maxpool1 = nn.MaxPool2d(kernel_size=3, stride=2)
        self.Mixed_5b = InceptionA(16, pool_features=4)
        self.Mixed_5c = InceptionA(32, pool_features=8)
        self.AuxLogits: InceptionAux | None = None
        if aux_logits:
            self.AuxLogits = InceptionAux(36, num_classes)
        self.Mixed_6a = InceptionB(36)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(p=dropout)
        self.fc = nn.Linear(72, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                stddev = float(m.stddev) if hasattr(m, "stddev") else 0.1  # type: ignore
                nn.init.trunc_normal_(m.weight, mean=0.0, std=stddev, a=-2, b=2)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def _transform_input(self, x: Tensor) -> Tensor:
        if self.transform_input:
            x_ch0 = torch.unsqueeze(x[:, 0], 1) * (0.229 / 0.5) + (0.485 - 0.5) / 0.5
            x_ch1 = torch.unsqueeze(x[:, 1], 1) * (0.224 / 0.5) + (0.456 - 0.5) / 0.5
            x_ch2 = torch.unsqueeze(x[:, 2], 1) * (0.225 / 0.5) + (0.406 - 0.5) / 0.5
            x = torch.cat((x_ch0, x_ch1, x_ch2), 1)
        return x

    def _forward(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        # N x 3 x 32 x 32
        x = self.Conv2d_1a_3x3(x)
        # N x 8 x 16 x 16
        x = self.Conv2d_2a_3x3(x)
        # N x 16 x 16 x 16
        x = self.maxpool1(x)
        # N x 16 x 7 x 7
        x = self.Mixed_5b(x)
        # N x 32 x 7 x 7
        x = self.Mixed_5c(x)
        # N x 36 x 7 x 7
        aux: Tensor | None = None
        if self.AuxLogits is not None:
            if self.training:
                aux = self.AuxLogits(x)
        x = self.Mixed_6a(x)
        # N x 72 x 3 x 3
        x = self.avgpool(x)
        # N x 72 x 1 x 1
        x = self.dropout(x)
        x = torch.flatten(x, 1)
        # N x 72
        x = self.fc(x)
        # N x num_classes
        return x, aux

    def eager_outputs(self, x: Tensor, aux: Tensor | None) -> InceptionOutputs | Tensor:
        if self.training and self.aux_logits:
            return InceptionOutputs(x, aux)
        else:
            return x  # type: ignore[return-value]

    def forward(self, x: Tensor) -> InceptionOutputs | Tensor:
        x = self._transform_input(x)
        x, aux = self._forward(x)
        return self.eager_outputs(x, aux)


def model() -> nn.Module:
    torch.manual_seed(0)
    return Inception3(num_classes=CLASSES, aux_logits=True)


def inputs(batch_size: int) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, 32, 32, generator=g),)


def targets(batch_size: int) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss(output: InceptionOutputs | Tensor, targets: Tensor) -> Tensor:
    if isinstance(output, Tensor):  # eval mode: logits only
        return F.cross_entropy(output, targets)
    return F.cross_entropy(output.logits, targets) + 0.4 * F.cross_entropy(output.aux_logits, targets)
