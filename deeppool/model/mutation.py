"""In-place operations: found by running the graph, made safe to split into layers.

Models mutate tensors in place everywhere: ``nn.ReLU(inplace=True)``,
``out += identity``, ``att.masked_fill_(mask, -inf)``, ``x[:, 0] = 0``. In
one process that is harmless; split into layers it is not: a layer that
mutates its input would write into another layer's output (or into a leaf
that autograd refuses to modify), and a later reader of the mutated tensor
must see the mutation although it reads the node that produced the tensor.

Mutations are found generically, not from a list of op names: every node is
run once (:func:`find_mutations` reads the probe's record of which input
tensors' version counters a node bumped), and the mutated tensor is traced
back through views to the node that produced its storage (its *base*). Then:

* the base's producer, the view chain, the mutating node and every node that
  returns the same tensor object are **merged into one layer**
  (:func:`merged_groups`), so the mutation happens on an intermediate of the
  layer, as in eager PyTorch;
* when the mutated tensor is a model input, or was read before the mutation
  by a node outside that layer, the mutation is moved onto a **clone** of it
  (inserted into the graph), so readers before it keep the old value;
* readers after the mutation are pointed at its **result**: the mutating node
  when it returns the tensor itself (``relu_``, ``+=``), else an inserted
  :func:`after_mutation` node that returns the tensor once the mutation ran
  (``fill_`` on a view, ``setitem``).

:func:`functionalize` applies these rewrites and probes again until a probe
needs none. Mutations of parameters and buffers (BatchNorm's running
statistics) are state, not data flow, and are left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from deeppool.errors import DeeppoolError

MAX_REWRITES = 500
"""Rewrite passes before giving up (each pass fixes one mutation per tensor)."""


def after_mutation(value: torch.Tensor, *mutations: Any) -> torch.Tensor:
    """``value`` once the nodes in ``mutations`` have run (a graph node that orders them)."""
    del mutations
    return value


@dataclass(frozen=True, kw_only=True)
class Probe:
    """What one run of the graph recorded: node values and the tensors each node mutated."""

    values: Mapping[str, Any]
    mutated: Mapping[str, tuple[torch.Tensor, ...]]


@dataclass(frozen=True, kw_only=True)
class Mutation:
    """Node ``node`` mutates (through views ``chain``) the tensor that ``base`` produced.

    ``aliases`` are the nodes whose value is that very tensor object (``base``
    among them); ``read`` is the node whose value the mutation's first step reads.
    """

    node: str
    base: str
    read: str
    chain: tuple[str, ...]
    aliases: tuple[str, ...]


def find_mutations(graph: fx.Graph, probe: Probe) -> list[Mutation]:
    """Every mutation of a data tensor (not a parameter or buffer), in graph order."""
    by_name = {node.name: node for node in graph.nodes}
    producer: dict[int, str] = {}
    aliases: dict[int, list[str]] = {}
    for node in graph.nodes:
        value = probe.values.get(node.name)
        if isinstance(value, torch.Tensor):
            producer.setdefault(id(value), node.name)
            aliases.setdefault(id(value), []).append(node.name)
    found = []
    for name, tensors in probe.mutated.items():
        for tensor in tensors:
            base = tensor._base if tensor._base is not None else tensor
            source = producer.get(id(base))
            if source is None or by_name[source].op == "get_attr":
                continue
            path = _chain(by_name[name], base, probe.values)
            if path is None:
                continue
            read, chain = path
            found.append(Mutation(node=name, base=source, read=read, chain=chain, aliases=tuple(aliases[id(base)])))
    order = {node.name: index for index, node in enumerate(graph.nodes)}
    return sorted(found, key=lambda m: order[m.node])


def _chain(node: fx.Node, base: torch.Tensor, values: Mapping[str, Any]) -> tuple[str, tuple[str, ...]] | None:
    """The node whose value the mutation starts from, and the views from it to what ``node`` mutates."""
    views: list[str] = []
    current = node
    while True:
        step = next((arg for arg in current.all_input_nodes if _shares(values.get(arg.name), base)), None)
        if step is None:
            return (views[-1], tuple(reversed(views[:-1]))) if views else None
        if values.get(step.name) is base:
            return step.name, tuple(reversed(views))
        views.append(step.name)
        current = step


def _shares(value: Any, base: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and (value is base or value._base is base)


def merged_groups(mutations: list[Mutation]) -> list[set[str]]:
    """Node sets that must share a layer: each mutated tensor's producer, aliases, views and mutators."""
    groups: list[set[str]] = []
    for mutation in mutations:
        members = {mutation.base, *mutation.aliases, *mutation.chain, mutation.node}
        overlapping = [group for group in groups if group & members]
        for group in overlapping:
            members |= group
            groups.remove(group)
        groups.append(members)
    return groups


def functionalize(module: fx.GraphModule, probe: Callable[[str | None], Probe]) -> tuple[Probe, list[Mutation]]:
    """Rewrite ``module`` until every mutation can live inside one layer; the last probe and its mutations.

    ``probe(until)`` runs the graph up to node ``until`` (all of it for None). A rewrite needs only the values
    up to the mutations it fixes, so while they all lie in the graph's first half (HF's ``shift_tokens_right``
    writes one tensor three times: three rewrites) the probes after a rewrite stop at the last of them; the
    result is always a whole run that needed no rewrite."""
    until: str | None = None
    for _ in range(MAX_REWRITES):
        recorded = probe(until)
        mutations = find_mutations(module.graph, recorded)
        if _rewrite(module.graph, mutations, recorded):
            module.recompile()
            until = _early_cut(module.graph, mutations)
        elif until is None:
            return recorded, mutations
        else:
            until = None
    raise DeeppoolError(f"the model's in-place operations need more than {MAX_REWRITES} rewrites")


def _early_cut(graph: fx.Graph, mutations: list[Mutation]) -> str | None:
    """The last mutating node when it lies in the first half of the graph's ops, else None (a whole run costs
    about as much)."""
    calls = [node.name for node in graph.nodes if node.op.startswith("call")]
    order = {name: index for index, name in enumerate(calls)}
    last = max(mutations, key=lambda m: order[m.node]).node
    return last if order[last] < len(calls) // 2 else None


def _rewrite(graph: fx.Graph, mutations: list[Mutation], probe: Probe) -> bool:
    """Fix the first mutation of each tensor that needs a clone, a result node or redirected readers."""
    order = {node.name: index for index, node in enumerate(graph.nodes)}
    by_name = {node.name: node for node in graph.nodes}
    related: dict[str, set[str]] = {}
    for mutation in mutations:
        related.setdefault(mutation.base, set()).update(mutation.aliases, mutation.chain, (mutation.node,))
    done: set[str] = set()
    for mutation in mutations:
        if mutation.base in done:
            continue
        fix = _Fix.of(mutation, related[mutation.base], by_name, order, probe)
        if fix.needed:
            fix.apply(graph, by_name)
            done.add(mutation.base)
    return bool(done)


@dataclass(frozen=True, kw_only=True)
class _Fix:
    """How one mutation is made splittable (see the module docstring)."""

    mutation: Mutation
    clone: bool
    result_node: bool
    result: str | None
    """The mutation's existing result node, if an earlier pass made one."""
    later_readers: tuple[tuple[str, str], ...]
    """(reader, alias it reads) pairs that run after the mutation."""

    @property
    def needed(self) -> bool:
        return self.clone or self.result_node or bool(self.later_readers)

    @classmethod
    def of(
        cls, mutation: Mutation, related: set[str], by_name: dict[str, fx.Node], order: dict[str, int], probe: Probe
    ) -> _Fix:
        """``related``: every node that produces, aliases, views or mutates the same tensor."""
        results = [user.name for user in by_name[mutation.node].users if user.target is after_mutation]
        own = {*mutation.chain, mutation.node, *results}
        at = order[mutation.node]
        before, after = [], []
        for alias in mutation.aliases:
            if order[alias] >= at:
                continue
            for user in by_name[alias].users:
                if order[user.name] < at and user.name not in related:
                    before.append((user.name, alias))
                elif order[user.name] > at and user.name not in own:
                    after.append((user.name, alias))
        clone = by_name[mutation.base].op == "placeholder" or bool(before)
        returns_base = probe.values.get(mutation.node) is probe.values[mutation.base]
        result_node = not returns_base and not results and (clone or bool(after))
        return cls(
            mutation=mutation, clone=clone, result_node=result_node, result=results[0] if results else None,
            later_readers=tuple(after),
        )

    def apply(self, graph: fx.Graph, by_name: dict[str, fx.Node]) -> None:
        m = self.mutation
        node = by_name[m.node]
        first = by_name[m.chain[0]] if m.chain else node
        read = by_name[m.read]
        if self.clone:
            with graph.inserting_before(first):
                read_now = graph.call_method("clone", (read,))
            first.replace_input_with(read, read_now)
        else:
            read_now = read
        result = by_name[self.result] if self.result is not None else node
        if self.result_node:
            with graph.inserting_after(node):
                result = graph.call_function(after_mutation, (read_now, node))
        for reader, alias in self.later_readers:
            by_name[reader].replace_input_with(by_name[alias], result)
