"""Importable factories for the ``package.module:callable`` model form."""

from torch import nn


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10)
    )


class TinyNet(nn.Module):
    """A module whose class rebuilds it with no arguments (``deeppool.plan`` records it as a factory)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.body(x)
