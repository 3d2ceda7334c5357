"""The GPT-2-style example (examples/gpt2.py) at a tiny size: vocab 50, 8 tokens, 2 blocks, d 16.

It reuses the example's modules, loaded from the file as the planner loads
model files, so the executor is tested on exactly the example's architecture.
"""

import importlib.util
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "gpt2.py"


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deeppool_example_gpt2", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GPT2_EXAMPLE = _example()
CONFIG = GPT2_EXAMPLE.GPTConfig(vocab_size=50, block_size=8, n_layer=2, n_head=2, d_model=16, dropout=0.0)


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
