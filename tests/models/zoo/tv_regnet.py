"""A small RegNetY written the way torchvision writes ``regnet.py`` (idioms copied, no import).

Idioms: ``BlockParams.from_init_params`` computes the stage widths with tensor arithmetic and
reads them back with ``.tolist()`` in the constructor (on the meta device that read fails, so
the planner builds and traces it on CPU), a ``SimpleStemIN`` (conv + BN + ReLU), ``ResBottleneckBlock``
with grouped 3x3 convolutions and squeeze-and-excitation (``AdaptiveAvgPool2d``, two 1x1 convolutions,
``scale * input``), a strided 1x1 projection shortcut, BN with zero-init of the last BN, the in-place
``ReLU``, ``flatten`` after the pool.

``[B, 3, 32, 32]`` -> ``[B, 10]``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CLASSES = 10


def conv_bn_act(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act: bool = True) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, groups=groups, bias=False),
                               nn.BatchNorm2d(cout)]
    if act:
        layers.append(nn.ReLU(inplace=True))
    return nn.Sequential(*layers)


class SqueezeExcitation(nn.Module):
    def __init__(self, channels: int, squeeze: int) -> None:
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.activation = nn.ReLU()
        self.scale_activation = nn.Sigmoid()

    def forward(self, x: Tensor) -> Tensor:
        scale = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return scale * x


class ResBottleneckBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, group_width: int, se_ratio: float) -> None:
        super().__init__()
        self.proj = conv_bn_act(cin, cout, 1, stride, act=False) if cin != cout or stride != 1 else None
        groups = cout // group_width
        self.f = nn.Sequential(
            conv_bn_act(cin, cout, 1),
            conv_bn_act(cout, cout, 3, stride, groups=groups),
            SqueezeExcitation(cout, max(1, int(round(se_ratio * cin)))),
            conv_bn_act(cout, cout, 1, act=False),
        )
        self.activation = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        if self.proj is not None:
            x = self.proj(x) + self.f(x)
        else:
            x = x + self.f(x)
        return self.activation(x)


def block_params(depth: int, w_0: int, w_a: float, w_m: float, group_width: int) -> list[tuple[int, int]]:
    """(width, depth) per stage, as torchvision's ``BlockParams.from_init_params`` computes them."""
    widths_cont = torch.arange(depth) * w_a + w_0
    block_capacity = torch.round(torch.log(widths_cont / w_0) / math.log(w_m))
    block_widths = (torch.round(torch.divide(w_0 * torch.pow(w_m, block_capacity), 8)) * 8).int().tolist()
    stages: list[tuple[int, int]] = []
    for width in block_widths:
        width = int(round(width / group_width) * group_width)
        if stages and stages[-1][0] == width:
            stages[-1] = (width, stages[-1][1] + 1)
        else:
            stages.append((width, 1))
    return stages


class RegNet(nn.Module):
    def __init__(self, num_classes: int = CLASSES) -> None:
        super().__init__()
        self.stem = conv_bn_act(3, 8, 3, 2)
        blocks: list[nn.Module] = []
        cin = 8
        for width, depth in block_params(depth=3, w_0=8, w_a=8.0, w_m=2.0, group_width=8):
            for index in range(depth):
                blocks.append(ResBottleneckBlock(cin, width, 2 if index == 0 else 1, 8, 0.25))
                cin = width
        self.trunk_output = nn.Sequential(*blocks)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, mean=0.0, std=math.sqrt(2.0 / (m.kernel_size[0] ** 2 * m.out_channels)))
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        x = self.trunk_output(self.stem(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def model() -> nn.Module:
    torch.manual_seed(0)
    return RegNet().train()


def inputs(batch_size: int) -> tuple[Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, 32, 32, generator=g),)


def targets(batch_size: int) -> Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss(output: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(output, targets)
