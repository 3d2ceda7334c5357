"""A model file that forgets inputs()."""

from torch import nn


def model() -> nn.Module:
    return nn.Linear(2, 2)
