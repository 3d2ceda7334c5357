"""Which modules K-FAC preconditions on a rank of a plan, and over which ranks.

A module is preconditioned where :func:`~deeppool.adaptation.kfac.preconditionable` holds (a ``Linear``, or
a ``Conv2d`` with one group, whose weight this rank holds) and the traced model calls it once (a module
called twice would mix two layers' statistics). Its group is its layer's ranks ``0..g-1``.
"""

from __future__ import annotations

from collections import Counter

from torch import fx

from deeppool.adaptation.kfac import preconditionable
from deeppool.executor.engine.local_model import plan_gpus
from deeppool.model.graph import LayerGraph
from deeppool.plans import Plan


def kfac_groups(plan: Plan, graph: LayerGraph, module: fx.GraphModule, rank: int) -> dict[str, tuple[int, ...]]:
    """Module name (as the traced model calls it) -> the ranks of its layer's group, for the modules K-FAC
    preconditions on ``rank`` (``module`` as the rank holds it: other layers' parameters dropped)."""
    nodes = {node.name: node for node in module.graph.nodes}
    calls = Counter(str(node.target) for node in module.graph.nodes if node.op == "call_module")
    groups: dict[str, tuple[int, ...]] = {}
    for layer in graph.layers:
        gpus = plan_gpus(plan, layer.name)
        if rank >= gpus:
            continue
        for node in (nodes[name] for name in layer.nodes):
            target = str(node.target)
            if node.op == "call_module" and calls[target] == 1 and preconditionable(module.get_submodule(target)):
                groups[target] = tuple(range(gpus))
    return groups
