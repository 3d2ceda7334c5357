"""Fidelity model: the GPT-2-style example (examples/gpt2.py) at a small size: 2 blocks, d 128, 32 tokens."""

import importlib.util
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpt2.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deeppool_example_gpt2", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GPT2_EXAMPLE = _example()
CONFIG = GPT2_EXAMPLE.GPTConfig(vocab_size=1000, block_size=32, n_layer=2, n_head=4, d_model=128, dropout=0.0)


def model() -> nn.Module:
    return GPT2_EXAMPLE.GPT2(CONFIG)


def inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, CONFIG.vocab_size, (batch_size, CONFIG.block_size), generator=g),)


def targets(batch_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, CONFIG.vocab_size, (batch_size, CONFIG.block_size), generator=g)


def loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(torch.flatten(output, 0, 1), torch.flatten(targets))
