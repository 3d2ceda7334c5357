"""A factory whose input is token ids: ``deeppool plan tests.models.token_factory:tiny_lm --input-shape 16
--input-dtype int64 --vocab-size 64``."""

from torch import nn


def tiny_lm() -> nn.Module:
    return nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 64))
