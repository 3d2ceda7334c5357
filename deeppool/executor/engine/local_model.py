"""The part of the model one rank holds: its layers, their parameters, synced BatchNorm.

The model is rebuilt from the plan's :class:`~deeppool.model.loading.ModelSpec`
(seeded, so identical on every rank) and traced again (deterministic node
names); the plan is refused if its layers are not this model's. The rank then
keeps only the parameters of the layers it runs, and a layer on ``g > 1``
ranks gets its BatchNorm modules replaced by :class:`GroupBatchNorm` over
ranks ``0..g-1``, and each stage it runs is compiled into one
:class:`~deeppool.executor.engine.stage_module.StageModule`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx, nn

from deeppool.errors import DeeppoolError
from deeppool.executor.config import BatchNormMode
from deeppool.executor.engine.program import Stage
from deeppool.executor.engine.stage_module import StageModule
from deeppool.model.graph import Layer, LayerGraph
from deeppool.model.randomness import RandomSites, SampleRandomness
from deeppool.model.syncbn import Reduce, sync_batch_norms
from deeppool.plans import Plan

GroupReduce = Callable[[tuple[int, ...]], Reduce]
"""Makes the in-place sum over a group of ranks."""


@dataclass(frozen=True)
class LocalModel:
    """The traced model as this rank holds it."""

    module: fx.GraphModule
    graph: LayerGraph
    stages: dict[int, StageModule]
    """The compiled stages this rank runs, by stage index."""
    params: dict[str, nn.Parameter]
    buffers: dict[str, torch.Tensor]
    reduce_params: dict[str, tuple[str, ...]]
    groups: dict[str, int]
    """The layer group (its GPU count) of each parameter and buffer this rank holds, by name."""
    random: SampleRandomness | None = None
    """The per-sample randomness mode the layers draw under (None: the model draws no random numbers)."""


def check_plan_matches(plan: Plan, graph: LayerGraph) -> None:
    """Refuse a plan made for another model (or another version of this one)."""
    where = plan.model.location
    if len(plan.layers) != len(graph.layers):
        raise DeeppoolError(
            f"plan does not match model '{where}': the plan has {len(plan.layers)} layers, "
            f"the model {len(graph.layers)}: re-plan this model"
        )
    for index, (planned, layer) in enumerate(zip(plan.layers, graph.layers, strict=True)):
        if (planned.name, planned.op) != (layer.name, layer.op):
            raise DeeppoolError(
                f"plan does not match model '{where}': layer {index} is '{planned.name}' ({planned.op}) "
                f"in the plan but '{layer.name}' ({layer.op}) in the model: re-plan this model"
            )
    for planned_branch, traced in zip(plan.branches, graph.branches, strict=False):
        if planned_branch != traced:
            raise DeeppoolError(
                f"the branch at {planned_branch.file}:{planned_branch.line} goes the other way here than when it was "
                f"planned (taken: {traced.taken}, planned: {planned_branch.taken}): re-plan this model"
            )
    if len(plan.branches) != len(graph.branches):
        raise DeeppoolError(
            f"the model takes {len(graph.branches)} branches on tensor values here, {len(plan.branches)} when planned: "
            "re-plan this model"
        )
    smallest = min(plan.global_batch, *(b - a for layer in plan.layers for a, b in layer.samples))
    if smallest < 1:
        widest = max(plan.layers, key=lambda layer: layer.gpus)
        raise DeeppoolError(
            f"layer '{widest.name}' uses {widest.gpus} GPUs for a global batch of {plan.global_batch}: "
            "every rank needs at least one sample; re-plan with a larger batch"
        )


def hold(
    plan: Plan, module: fx.GraphModule, graph: LayerGraph, rank: int, reduce: GroupReduce,
    stages: tuple[Stage, ...], random: RandomSites | None = None, batchnorm: BatchNormMode = BatchNormMode.SYNC,
) -> LocalModel:
    """Keep rank ``rank``'s layers and parameters of ``module``; install synced BatchNorm; compile its stages.

    With ``random`` sites, the layers draw per sample, seeded by the plan's model seed. With
    ``BatchNormMode.LOCAL`` the BatchNorm modules stay as they are: each rank normalises its own samples.
    """
    mine = [layer for layer in graph.layers if rank < plan_gpus(plan, layer.name)]
    names = {name for layer in mine for name in layer.params}
    params = {name: _attr(module, name) for name in sorted(names)}
    buffers = _buffers(module, mine)
    groups = _groups(plan, module, mine)
    _drop_others(module, names)
    for layer in mine:
        gpus = plan_gpus(plan, layer.name)
        if gpus > 1 and batchnorm is BatchNormMode.SYNC:
            sync_batch_norms(module, layer, reduce(tuple(range(gpus))))
    mode = random.mode(plan.model.seed) if random else None
    drawing = (random, mode) if random is not None and mode is not None else None
    compiled = {stage.index: _compile(module, graph, stage, drawing) for stage in stages if rank < stage.gpus}
    return LocalModel(
        module=module, graph=graph, stages=compiled, params=params, buffers=buffers,
        reduce_params=_reduce_owners(plan, graph, mine), groups=groups, random=mode,
    )


def _compile(
    module: fx.GraphModule, graph: LayerGraph, stage: Stage, random: tuple[RandomSites, SampleRandomness] | None
) -> StageModule:
    """The stage's layers as one module, returning the values read outside it (and the model's output)."""
    inside = set(stage.layers)
    read_outside = {src for layer in graph.layers if layer.name not in inside for src in layer.inputs}
    outputs = [name for name in stage.layers if name in read_outside or name == graph.output]
    layers = {layer.name: layer for layer in graph.layers}
    return StageModule(module, [layers[name] for name in stage.layers], outputs, random)


def plan_gpus(plan: Plan, layer: str) -> int:
    for planned in plan.layers:
        if planned.name == layer:
            return planned.gpus
    raise KeyError(layer)


def _reduce_owners(plan: Plan, graph: LayerGraph, mine: list[Layer]) -> dict[str, tuple[str, ...]]:
    """Each parameter is all-reduced once, after the last backward that touches it."""
    first: dict[str, Layer] = {}
    for layer in graph.layers:
        for name in layer.params:
            owner = first.setdefault(name, layer)
            if plan_gpus(plan, owner.name) != plan_gpus(plan, layer.name):
                raise DeeppoolError(
                    f"parameter '{name}' is shared by layers '{owner.name}' and '{layer.name}' with different "
                    "GPU counts: give them the same count"
                )
    return {layer.name: tuple(n for n in layer.params if first[n] is layer) for layer in mine}


def _groups(plan: Plan, module: fx.GraphModule, layers: list[Layer]) -> dict[str, int]:
    """Each parameter's and buffer's layer group: the GPU count of the first layer that uses it."""
    found: dict[str, int] = {}
    for layer in layers:
        gpus = plan_gpus(plan, layer.name)
        for name in (*layer.params, *_buffers(module, [layer])):
            found.setdefault(name, gpus)
    return found


def _buffers(module: fx.GraphModule, layers: list[Layer]) -> dict[str, torch.Tensor]:
    """Buffers (BatchNorm running statistics...) the rank's layers use, by their name in the model."""
    by_name = {node.name: node for node in module.graph.nodes}
    named = {id(buffer): name for name, buffer in module.named_buffers()}
    found: dict[str, torch.Tensor] = {}
    for layer in layers:
        for node in (by_name[n] for n in layer.nodes):
            if node.op == "call_module":
                used = list(module.get_submodule(str(node.target)).buffers())
            elif node.op == "get_attr":
                used = [_attr_value(module, str(node.target))]
            else:
                continue
            found.update({named[id(b)]: b for b in used if isinstance(b, torch.Tensor) and id(b) in named})
    return found


def _attr_value(module: nn.Module, dotted: str) -> object:
    return operator.attrgetter(dotted)(module)


def _attr(module: nn.Module, dotted: str) -> nn.Parameter:
    value = _attr_value(module, dotted)
    assert isinstance(value, nn.Parameter), dotted
    return value


def _drop_others(module: nn.Module, keep: set[str]) -> None:
    """Free every parameter this rank does not run (its layers never read them), under every name."""
    kept = {id(_attr(module, name)) for name in keep}
    for name, param in list(module.named_parameters(remove_duplicate=False)):
        if id(param) not in kept:
            owner_path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_path) if owner_path else module
            owner._parameters[leaf] = None
