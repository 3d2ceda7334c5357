"""Rewriting in-place operations: probes after a rewrite stop at the mutations when they lie early in the graph,
and the graph that comes out is the one whole-graph probes give (:func:`deeppool.model.mutation.functionalize`)."""

from __future__ import annotations

from unittest import mock

import torch
from torch import nn

from deeppool.model import mutation
from deeppool.model.loading import LoadedModel, default_loss
from deeppool.model.trace import trace
from tests.planner.test_any_model import layer_by_layer


class Shifted(nn.Module):
    """HF's ``shift_tokens_right`` (one tensor written three times in place), then a long tail."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(12))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()
        shifted[:, 0] = 2
        shifted.masked_fill_(shifted == 15, 0)
        x = self.emb(shifted)
        for block in self.blocks:
            x = torch.relu(block(x)) + x
        return x


def _loaded() -> LoadedModel:
    torch.manual_seed(0)
    model = Shifted()
    return LoadedModel(model, lambda b: {"ids": torch.randint(0, 16, (b, 6), generator=torch.Generator().manual_seed(b))},
                       lambda b: None, default_loss)


def _traced(whole: bool) -> tuple[object, list[str | None]]:
    seen: list[str | None] = []
    real = mutation.functionalize

    def watched(module, probe):
        def recording(until):
            seen.append(until)
            return probe(None if whole else until)
        return real(module, recording)

    with mock.patch("deeppool.model.trace.functionalize", watched):
        return trace(_loaded()), seen


def test_probes_after_a_rewrite_stop_early_and_the_graph_is_the_whole_runs():
    fast, seen = _traced(whole=False)
    slow, _ = _traced(whole=True)
    assert seen[0] is None and seen[-1] is None, seen
    assert any(until is not None for until in seen), "the rewrites of the early writes probed the whole graph"
    assert fast.graph == slow.graph and fast.module.code == slow.module.code
    loaded = _loaded()
    named = loaded.named_inputs(4)
    torch.testing.assert_close(layer_by_layer(fast, named), loaded.module(**named))
