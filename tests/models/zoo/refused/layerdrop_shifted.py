"""Refused: LayerDrop above 0 as transformers 4.x writes it, in a model torch.fx cannot trace at its root.

The zoo's ``layerdrop_shifted.py`` with probability 0.2: the real-tensor tracer meets a random draw
compared with 0.2, a branch that goes both ways from step to step. ``deeppool plan`` must refuse it
with one line saying it is LayerDrop above 0.
"""

import torch
from torch import nn

from tests.models.zoo.layerdrop_shifted import Seq2Seq, inputs

__all__ = ["inputs", "model"]


def model() -> nn.Module:
    torch.manual_seed(0)
    return Seq2Seq(layerdrop=0.2).train()
