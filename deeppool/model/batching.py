"""Refuse, before training, a model whose layers mix the samples of a batch.

Burst parallelism splits the batch across ranks differently for every layer,
which is exact only if every layer computes each sample from that sample
alone (BatchNorm excepted: the executor synchronises it). An op like
``x - x.mean(0)``, ``x.view(-1)`` followed by a reduction, or a value built
from a sample's position in the batch breaks that silently.

The check is numeric and generic: the traced model runs on ``inputs(3)`` and
on samples 1 and 2 of it alone, with the same per-sample randomness, and each
layer's output rows for samples 1 and 2 are compared. A layer whose rows
differ although all its inputs matched mixes samples; it is named with its
module. Comparing a suffix, not a prefix, also catches values that depend on
a sample's position (``arange(batch)`` used as data).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx, nn

from deeppool.errors import DeeppoolError
from deeppool.model.graph import OUTPUT_LAYER, Layer
from deeppool.model.layer_exec import LayerFailed, LayerRunner, run_at
from deeppool.model.loading import LoadedModel
from deeppool.model.trace import Traced

PROBE_SAMPLES = 3
RELATIVE_TOLERANCE = 1e-3
"""Round-off between batch sizes is about 1e-7; a mixed sample differs by far more."""


def check_per_sample(traced: Traced, loaded: LoadedModel, *, seed: int) -> None:
    """Raise naming the first layer whose output for a sample depends on the other samples."""
    named = loaded.named_inputs(PROBE_SAMPLES)
    suffix = {key: value[1:] if isinstance(value, torch.Tensor) else value for key, value in named.items()}
    module = traced.module
    with _buffers_kept(module):
        whole = _layer_values(traced, named, seed=seed, offset=0)
        part = _layer_values(traced, suffix, seed=seed, offset=1)
    matched: set[str] = set(traced.graph.inputs)
    for layer in traced.graph.layers:
        if layer.name == OUTPUT_LAYER:
            continue
        if _same(whole[layer.name][1:], part[layer.name]):
            matched.add(layer.name)
        elif all(name in matched for name in layer.inputs) and not normalises_batch(module, layer):
            raise DeeppoolError(
                f"layer '{layer.name}' ({layer.op} in module '{layer.target}') mixes the samples of a batch: "
                "its output for one sample changes with the others, so it cannot be split across GPUs; "
                "only per-sample operations and BatchNorm can"
            )


def check_plan_batches(traced: Traced, loaded: LoadedModel, batches: Mapping[str, int], *, seed: int) -> None:
    """Refuse a plan that gives a layer a per-GPU batch (``batches``, by layer) at which its ops raise.

    :func:`check_per_sample` has run every layer at 2 and 3 samples; a plan that gives some layer fewer
    (a device model's plan, which measured nothing) runs the model at that batch, forward, layer by layer.
    A layer that fails there is refused only if the plan gives it that batch and it is no BatchNorm (the
    executor runs those over the layer's whole batch); a layer given more samples that fails stops the probe,
    since nothing after it can run."""
    smallest = min(batches.values(), default=PROBE_SAMPLES)
    if smallest >= PROBE_SAMPLES - 1:
        return
    try:
        with _buffers_kept(traced.module):
            _layer_values(traced, loaded.named_inputs(smallest), seed=seed, offset=0, samples=smallest)
    except LayerFailed as err:
        if batches.get(err.layer.name) == smallest and not normalises_batch(traced.module, err.layer):
            raise DeeppoolError(f"{err}; the plan gives it per-GPU batch {smallest}: re-plan with fewer GPUs or a "
                                "larger --batch, or with --device-model local, which measures such batches and "
                                "does not use them") from None


@contextmanager
def _buffers_kept(module: nn.Module) -> Iterator[None]:
    """Buffers (BatchNorm's running statistics) as they were before the probe."""
    saved = {name: buffer.clone() for name, buffer in module.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name, buffer in module.named_buffers():
                buffer.copy_(saved[name])


def _layer_values(traced: Traced, named: Mapping[str, Any], *, seed: int, offset: int,
                  samples: int = PROBE_SAMPLES) -> dict[str, Any]:
    """Every layer's output when the model runs on ``named`` (rows from ``offset`` of ``samples``)."""
    graph = traced.graph
    env: dict[str, Any] = {name: named[key] for name, key in zip(graph.inputs, graph.input_keys, strict=True)}
    mode = traced.random.mode(seed)
    with torch.no_grad(), mode.at(step=0, offset=offset, ordinal=0):
        for layer in graph.layers:
            runner = LayerRunner(traced.module, layer, (traced.random, mode))
            env[layer.name] = run_at(runner, [env[name] for name in layer.inputs], samples - offset)
    return env


def _same(expected: Any, got: Any) -> bool:
    if not isinstance(expected, torch.Tensor) or not isinstance(got, torch.Tensor):
        return True
    if expected.shape != got.shape:
        return False
    if not expected.is_floating_point():
        return bool(torch.equal(expected, got))
    equal = (expected == got) | (expected.isnan() & got.isnan())
    if bool(equal.all()):
        return True
    finite = expected[expected.isfinite()]
    scale = float(finite.abs().max()) if finite.numel() else 0.0
    gap = (expected - got).abs().masked_fill(equal, 0.0)
    return float(gap.max()) <= RELATIVE_TOLERANCE * max(scale, 1e-6)


def normalises_batch(module: fx.GraphModule, layer: Layer) -> bool:
    """Whether the layer contains batch normalisation (which the executor synchronises)."""
    by_name = {node.name: node for node in module.graph.nodes}
    for name in layer.nodes:
        node = by_name[name]
        if node.op == "call_module" and isinstance(module.get_submodule(str(node.target)), nn.modules.batchnorm._BatchNorm):
            return True
        if node.op == "call_function" and "batch_norm" in getattr(node.target, "__name__", str(node.target)):
            return True
    return False
