"""MLP-Mixer (Tolstikhin et al., NeurIPS 2021) sized for 32x32 images (CIFAR-10 style).

Input: images ``[batch, 3, 32, 32]``; output: logits ``[batch, 10]``.

The image is cut into 4x4 patches (64 tokens), each projected to ``DIM``
channels by a strided convolution. Each of ``DEPTH`` blocks mixes across tokens
(a two-layer MLP applied to every channel, after a transpose) and then across
channels (a two-layer MLP applied to every token), each behind a LayerNorm and
with a residual connection. A final LayerNorm, a mean over tokens and a linear
head give the logits. No convolution after the first: its cost is in matrix
products whose shapes differ between the token and the channel MLPs, so its
layers scale differently with the per-GPU batch (the planner's material).

Model-file convention (see ``examples/README.md``); every operation is
per-sample along dim 0, and the network traces with ``torch.fx.symbolic_trace``.

    deeppool plan examples/mixer.py --gpus 2 --batch 32                       # measured on this machine
    deeppool run mixer-plan.json --background examples/background_mlp.py      # a background in its idle time
"""

import torch
import torch.nn.functional as F
from torch import nn

IMAGE_SIZE, PATCH, CHANNELS = 32, 4, 3
DIM, TOKEN_HIDDEN, CHANNEL_HIDDEN, DEPTH = 128, 64, 512, 4
NUM_CLASSES = 10
TOKENS = (IMAGE_SIZE // PATCH) ** 2


class MlpBlock(nn.Module):
    def __init__(self, features: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(features, hidden)
        self.fc2 = nn.Linear(hidden, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class MixerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.token_norm = nn.LayerNorm(DIM)
        self.token_mix = MlpBlock(TOKENS, TOKEN_HIDDEN)
        self.channel_norm = nn.LayerNorm(DIM)
        self.channel_mix = MlpBlock(DIM, CHANNEL_HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [batch, tokens, dim]
        x = x + self.token_mix(self.token_norm(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mix(self.channel_norm(x))


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(CHANNELS, DIM, kernel_size=PATCH, stride=PATCH)
        self.blocks = nn.Sequential(*(MixerBlock() for _ in range(DEPTH)))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, NUM_CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images).flatten(2).transpose(1, 2)  # [batch, tokens, dim]
        x = self.norm(self.blocks(x))
        return self.head(x.mean(dim=1))


def model() -> nn.Module:
    torch.manual_seed(0)
    return Mixer()


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch_size, CHANNELS, IMAGE_SIZE, IMAGE_SIZE, generator=g),)


def targets(batch_size: int) -> torch.Tensor:
    return torch.randint(0, NUM_CLASSES, (batch_size,), generator=torch.Generator().manual_seed(1))


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, targets)
