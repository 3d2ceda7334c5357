"""A CNN whose activations are channels-last views, as ConvNeXt's are: a convolution, a LayerNorm over the
channels between two permutes, then a depthwise convolution that reads the channels-last view."""

import torch
from torch import nn


class ChannelsLastNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.LayerNorm(8)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv(x).permute(0, 2, 3, 1)
        x = self.norm(x).permute(0, 3, 1, 2)
        x = torch.relu(self.depthwise(x))
        return self.head(x.mean(dim=(2, 3)))


def model() -> nn.Module:
    torch.manual_seed(0)
    return ChannelsLastNet()


def inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 3, 6, 6, generator=torch.Generator().manual_seed(0)),)
