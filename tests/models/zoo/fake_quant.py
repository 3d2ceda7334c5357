"""Quantization-aware training with custom autograd Functions, as QAT and VQ code writes them.

Idioms: ``FakeQuantize.apply(x, bits)``, a straight-through estimator (``round`` in forward,
the gradient passed through inside the clipping range and zero outside, from
``ctx.save_for_backward``), with a Python int argument; and ``ScaleGrad.apply``, identity in
forward with a gradient scaled in backward (gradient reversal's shape). Differentiating their
forwards' ops instead (``round``'s zero gradient, the identity's one) trains a different model:
each must stay one call of its ``apply``.
"""

import torch
import torch.nn.functional as F
from torch import nn

CLASSES = 4


class FakeQuantize(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, bits: int) -> torch.Tensor:
        ctx.save_for_backward(x)
        levels = 2 ** (bits - 1)
        return torch.round(x.clamp(-1.0, 1.0) * levels) / levels

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (x,) = ctx.saved_tensors
        return grad * (x.abs() <= 1.0), None


class ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return -0.5 * grad


class QuantBlock(nn.Module):
    def __init__(self, channels: int, bits: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bits = bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + FakeQuantize.apply(torch.tanh(self.conv(x)), self.bits)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.Sequential(QuantBlock(8, 4), QuantBlock(8, 2))
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(torch.relu(self.stem(x)))
        return self.head(ScaleGrad.apply(x.mean(dim=(2, 3))))


def model() -> nn.Module:
    torch.manual_seed(0)
    return Net().train()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, 3, 8, 8, generator=g),)


def targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CLASSES, (batch_size,), generator=g)


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
