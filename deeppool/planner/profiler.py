"""The per-layer profiler: forward and backward time of every layer, measured.

Each layer runs alone (:class:`LayerRunner`) on the activations its producers
computed, at every requested per-GPU batch size: ``warmup`` untimed runs, then
the median of ``repeats`` timed ones (``time.perf_counter`` on the CPU, CUDA
events on a GPU). Results are cached on disk by layer signature, input
shapes, batch, dtype, device and torch version, so re-planning the same model
(or another model with the same layers) measures nothing again.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import Progress

from deeppool.errors import DeeppoolError
from deeppool.planner.graph import Layer, LayerGraph
from deeppool.planner.jsonio import write_json
from deeppool.planner.layer_exec import LayerRunner
from deeppool.planner.modelspec import LoadedModel
from deeppool.planner.profile import LayerTimes, Profile
from deeppool.planner.trace import Traced


@dataclass(frozen=True, kw_only=True)
class ProfilerConfig:
    device: str = "cpu"
    batches: tuple[int, ...] = (1, 2, 4, 8)
    warmup: int = 2
    repeats: int = 5
    cache_dir: Path | None = None
    show_progress: bool = True

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 1:
            raise DeeppoolError("profile batch sizes must be >= 1")
        if self.repeats < 1 or self.warmup < 0:
            raise DeeppoolError("--repeats must be >= 1 and --warmup >= 0")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise DeeppoolError(f"--device {self.device}: no CUDA device here; use --device cpu or a device model")


class ProfileCache:
    """A JSON file of measured (fwd_ms, bwd_ms) by measurement key."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "layer-times.json"
        self.entries: dict[str, list[float]] = {}
        if self.path.is_file():
            try:
                self.entries = json.loads(self.path.read_text())
            except json.JSONDecodeError:
                self.entries = {}

    def get(self, key: str) -> tuple[float, float] | None:
        found = self.entries.get(key)
        return (found[0], found[1]) if found else None

    def put(self, key: str, times: tuple[float, float]) -> None:
        self.entries[key] = list(times)

    def save(self) -> None:
        write_json(self.path, self.entries)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "-").lower()
    return f"cpu-{os.cpu_count()}c-{torch.get_num_threads()}t"


def device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_bandwidth(device: torch.device, megabytes: int = 64, repeats: int = 5) -> float:
    """Effective bytes/s of an in-place add over large tensors (what an optimizer step does)."""
    count = megabytes * 2**20 // 4
    left, right = torch.ones(count, device=device), torch.ones(count, device=device)
    times = []
    for _ in range(repeats + 1):
        elapsed, _ = _timed(device, lambda: left.add_(right, alpha=1e-6))
        times.append(elapsed)
    return 3 * count * 4 / (statistics.median(times[1:]) / 1e3)


def measure_profile(traced: Traced, loaded: LoadedModel, config: ProfilerConfig) -> Profile:
    """Measure every layer of ``traced`` at ``config.batches`` on ``config.device``."""
    device = torch.device(config.device)
    graph = traced.graph
    traced.module.to(device)
    cache = ProfileCache(config.cache_dir) if config.cache_dir else None
    batches = tuple(sorted(set(config.batches)))
    times: dict[str, list[tuple[float, float]]] = {layer.name: [] for layer in graph.layers}
    runners = {layer.name: LayerRunner(traced.module, layer) for layer in graph.layers}
    with Progress(disable=not config.show_progress, transient=True) as progress:
        task = progress.add_task(f"profiling on {device_name(device)}", total=len(batches) * len(graph))
        for batch in batches:
            for layer, measured in _measure_batch(graph, runners, loaded, batch, device, config, cache):
                times[layer].append(measured)
                progress.advance(task)
    if cache:
        cache.save()
    for parameter in traced.module.parameters():
        parameter.grad = None  # timing the backward passes left gradients behind
    return Profile(
        device=device_name(device),
        source="measured",
        dtype=graph.layers[0].dtype if graph.layers else "float32",
        memory_bytes=device_memory(device),
        memory_bandwidth=memory_bandwidth(device),
        layers={
            name: LayerTimes(
                batches=batches,
                fwd_ms=tuple(t[0] for t in measured),
                bwd_ms=tuple(t[1] for t in measured),
            )
            for name, measured in times.items()
        },
    )


def _measure_batch(
    graph: LayerGraph,
    runners: dict[str, LayerRunner],
    loaded: LoadedModel,
    batch: int,
    device: torch.device,
    config: ProfilerConfig,
    cache: ProfileCache | None,
):
    """Yield (layer, (fwd_ms, bwd_ms)) for every layer at ``batch``, keeping few activations alive."""
    env = dict(zip(graph.inputs, (t.to(device) for t in loaded.inputs(batch)), strict=True))
    last_use = {name: index for index, layer in enumerate(graph.layers) for name in layer.inputs}
    for index, layer in enumerate(graph.layers):
        args = [env[name] for name in layer.inputs]
        key = _key(layer, args, batch, device, config)
        measured = cache.get(key) if cache else None
        if measured is None:
            measured, env[layer.name] = _time_layer(runners[layer.name], args, device, config)
            if cache:
                cache.put(key, measured)
        else:
            with torch.no_grad():
                env[layer.name] = runners[layer.name](*args)
        for name in layer.inputs:
            if last_use.get(name) == index:
                env.pop(name, None)
        yield layer.name, measured


def _key(layer: Layer, args: list[torch.Tensor], batch: int, device: torch.device, config: ProfilerConfig) -> str:
    shapes = [(tuple(a.shape[1:]), str(a.dtype)) for a in args]
    text = f"{layer.signature}|{shapes}|{batch}|{device_name(device)}|{torch.__version__}|{config.warmup}|{config.repeats}"
    return hashlib.sha256(text.encode()).hexdigest()


def _time_layer(
    runner: LayerRunner, args: list[torch.Tensor], device: torch.device, config: ProfilerConfig
) -> tuple[tuple[float, float], torch.Tensor]:
    """Median (fwd_ms, bwd_ms) over the timed repeats, and the layer's output (detached)."""
    fwd: list[float] = []
    bwd: list[float] = []
    for repeat in range(config.warmup + config.repeats):
        inputs = [a.detach().requires_grad_(a.is_floating_point()) for a in args]
        forward_ms, output = _timed(device, lambda: runner(*inputs))
        backward_ms = 0.0
        if output.requires_grad:
            gradient = torch.ones_like(output)
            backward_ms, _ = _timed(device, lambda: output.backward(gradient))
        if repeat >= config.warmup:
            fwd.append(forward_ms)
            bwd.append(backward_ms)
    return (statistics.median(fwd), statistics.median(bwd)), output.detach()


def _timed(device: torch.device, work: Callable[[], object]) -> tuple[float, object]:
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end), result
    began = time.perf_counter()
    result = work()
    return 1e3 * (time.perf_counter() - began), result
