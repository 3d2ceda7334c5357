"""The per-layer profiler: forward and backward time of every layer, measured, then fitted.

Layers are timed in context, as they run in training: a *pass* runs every
layer's forward in order (:class:`CompiledLayerRunner`: generated code, as the executor runs a stage),
each on detached inputs that take gradients where the executor's do (not the model's inputs, nor outputs
no parameter feeds), then every layer's backward in reverse with the
gradient its consumers sent (:class:`Passes`), so a layer finds its input
activations and output gradient fresh in the cache and its weights and saved
activations evicted by the rest of the model, as it does in an iteration.
Timing each layer alone in a loop instead found it hot: 7-15% faster than in
context for this repository's CNN, MLP and transformer on this 2-core VM.
Each per-GPU batch of ``batches`` gets ``warmup`` untimed passes, then timed
passes (``time.perf_counter`` on the CPU, CUDA events on a GPU) in rounds of
``repeats`` until every layer's spread over the kept passes (outliers beyond
3 scaled median absolute deviations, MAD, dropped; spread = scaled MAD over
the median) is within ``spread_bound`` (layers under the timer's noise floor
aside), or ``max_repeats`` passes were taken; a measurement still wider is
counted as noisy and the profile says how many there were. Each per-layer
split adds what a stage never pays (a leaf per input, one
``torch.autograd.backward`` call per layer: up to 10%, mostly backward, on this
CPU, ``benchmarks/backward_split.py``), so ``repeats`` whole passes follow,
chained as a one-stage executor runs them (:meth:`Passes.whole`), and the
batch's layer times are scaled so that they add up to it
(:class:`~deeppool.planner.profile.WholePass`, kept in the profile). On the CPU
``threads`` sets the intra-op threads while measuring (a rank of a run on
this host gets ``cores / ranks`` of them; a busy machine stalls
multi-threaded kernels far more than single-threaded ones).

Every layer's times are then fitted by ``t(s) = a + b·s`` (least squares,
``a, b ≥ 0``), which is what a layer's time does once the batch fills the
device. A profile holds, at every measured batch, the measured medians (a
layer below the timer's noise floor: the line), and at the other batches of
``fit_to`` (the planner's) the line; the per-sample time never falls as the
batch shrinks (a smaller batch is raised to the larger one's rate), so a
noisy point cannot make a layer on ``g`` GPUs cost less GPU-time than on one.
The planner measures every per-GPU batch its plan uses
(:mod:`deeppool.planner.measure_loop`), so the line only fills in batches no
plan runs, or those above a cap the user set. The fit's relative error at the
measured points is reported (:class:`~deeppool.planner.profile.FitQuality`),
and every time carries the spread of its repeated measurements.

Beyond the layers, the profiler measures what an iteration runs outside them:
the model's loss function on the output layer's value at each batch (forward,
then backward, fitted as a layer is), and each optimizer's cost beyond its
memory traffic (:func:`measure_step_overhead`: a fixed cost per ``step()`` and
``zero_grad()`` call and one per parameter tensor; :func:`measure_model_step`: one
per megabyte of the model's own parameters, stepped right after a backward).

Results are cached on disk by the layer's code (its fx nodes, the source of
the modules and functions they call), its input shapes and dtypes, the batch,
the device, torch's version and the measuring settings; each entry records
what it was measured under (load, cores, threads, torch, device). The
cache is written as it goes (at most once a second, and when the run ends or
is interrupted), so re-planning the same model, or resuming an interrupted
run, measures nothing twice. A measurement taken on a busy machine (load
above the cores; the load is the tasks running around it, read from ``/proc``
by :mod:`deeppool.planner.hostload`, not the lagging 1-minute average), one
that stayed noisy, or one during which the host's speed changed is
*untrusted*: it is measured again whenever the machine is not busy, the
steadier of the two kept (a noisy draw does not stay in the cache while the
load is what it was), and otherwise kept but flagged (:attr:`LayerTimes.busy`),
so the plan names the layers resting on it.

**The host's speed.** A shared VM's speed moves without its load average
showing it: on this 2-core VM a fixed piece of work took 45-55 ms from one
second to the next, the held-out BERT's layers all measured about 1.6x their
usual times for a minute (its plan predicted 48.8 ms, the run took 36.9), and
the cache then gave those times to every later plan of the model. So a fixed
reference work (:func:`reference_ms`) is timed before and after each batch is
measured, and the cache records it beside the times: a batch whose reference
moved by more than ``speed_bound`` (20%) while it was measured is untrusted and measured again
right away (``retries``, twice at most, the steadiest attempt kept), and a
cached batch whose reference differs by more than ``reuse_bound`` (10%) from the
host's now is measured again and the new times kept (they are this speed's).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from functools import cache, cached_property
from pathlib import Path

import torch
from rich.progress import Progress
from torch import fx
from torch.utils import _pytree as pytree

from deeppool.device.cuda import CudaGpu, gpu_for
from deeppool.device.seam import Gpu
from deeppool.errors import DeeppoolError
from deeppool.planner.allocator import steady_allocator
from deeppool.planner.graph import Layer, LayerGraph, grad_flows
from deeppool.planner.group_times import GroupedLayers
from deeppool.planner.hostload import runnable_now
from deeppool.planner.jsonio import write_json
from deeppool.planner.layer_exec import LayerFailed, LayerRunner, floating_leaves, run_at, runners
from deeppool.planner.modelspec import LoadedModel
from deeppool.planner.cost import Optimizer
from deeppool.planner.randomness import SampleRandomness
from deeppool.planner.profile import Conditions, FitQuality, LayerTimes, Profile, StepOverhead, WholePass
from deeppool.planner.trace import Traced


def reference_ms(repeats: int = 3) -> float:
    """The host's speed now: the median ms of a fixed piece of work on the calling thread's intra-op threads,
    some 256×256 matmuls and many small ops (the steps this profiler times are made of both)."""
    big, small, weight = torch.ones(256, 256), torch.ones(32, 64), torch.ones(64, 64)

    def work() -> None:
        for _ in range(16):
            torch.mm(big, big)
        for _ in range(300):
            torch.relu(torch.mm(small, weight) + 1.0)

    work()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


@dataclass(frozen=True, kw_only=True)
class ProfilerConfig:
    device: str = "cpu"
    batches: tuple[int, ...] = (2, 4, 8)
    fit_to: tuple[int, ...] = ()
    warmup: int = 1
    repeats: int = 3
    max_repeats: int = 9
    spread_bound: float = 0.1
    threads: int | None = None
    ranks: int | None = None
    """The ranks a run will start on this host: on a CPU the profiler measures how they share its cores."""
    cache_dir: Path | None = None
    show_progress: bool = True
    load: Callable[[], float] = runnable_now
    """How busy the host is now, on the load average's scale (:func:`deeppool.planner.hostload.runnable_now`:
    the tasks runnable now, this process counted as one): read before and after each batch is measured."""
    reference: Callable[[], float] | None = reference_ms
    """How fast the host is now (:func:`reference_ms`): read before and after each batch is measured on a CPU;
    None: not read."""
    speed_bound: float = 0.2
    """A reference that moved by more than this share (of the faster reading) while a batch was measured means
    the host's speed changed under it: the batch is untrusted."""
    retries: int = 2
    """A batch measured while the host's speed moved (beyond ``speed_bound``) is measured again right away, at
    most this many times while the machine is not busy, and the steadiest attempt kept: each plan-time miss of
    the held-out sets 8 and 9 rested on a batch whose every layer was flagged untrusted and kept (one measured
    while the reference moved 24%, ``docs/performance.md``)."""
    reuse_bound: float = 0.1
    """A cached batch whose reference differs by more than this share from the host's now is measured again:
    the cached times are another speed's (the held-out benchmark's single-rank rows tracked the reference
    within a few percent when their plans rested on times cached 20% faster, ``docs/performance.md``)."""
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    """A load above this many cores means the machine was busy: such measurements are not trusted."""
    memory_budget: int | None = None
    """Bytes a profiling pass may take; None: :func:`memory_budget` of the device."""

    def untrusted(self, measured: Measured) -> bool:
        """Whether ``measured`` was taken on a busy machine or while the host's speed moved (:meth:`busy`), or
        stayed noisy (a layer above the noise floor)."""
        noisy = measured.spread > self.spread_bound and measured.fwd_ms + measured.bwd_ms >= _NOISE_FLOOR_MS
        return self.busy(measured) or noisy

    def busy(self, measured: Measured) -> bool:
        """Whether ``measured`` was taken with more runnable work than cores, or while the host's speed changed."""
        return measured.load > self.cores or measured.speed_change > self.speed_bound

    def moved(self, measured: Measured, now_ms: float) -> bool:
        """Whether the host's speed now (reference ``now_ms``, 0: not read) differs from when ``measured`` was taken."""
        return _change(measured.reference_ms, now_ms) > self.reuse_bound

    def remeasure(self, found: Iterable[Measured], now_ms: float = 0.0) -> bool:
        """Whether cached measurements are to be taken again, the machine not being busy now: some are
        untrusted (so quieter than a busy one's load, or another draw of a noisy one), or the host's speed
        moved since they were taken (reference ``now_ms``)."""
        found = list(found)
        stale = any(self.untrusted(m) or self.moved(m, now_ms) for m in found)
        return stale and self.load() <= self.cores

    def noise(self, found: Iterable[Measured]) -> tuple[bool, float]:
        """How far one batch's measurements are from trustworthy, to keep the steadier of two: whether any
        was taken on a busy machine, then their spread weighted by their times."""
        found = list(found)
        total = sum(m.fwd_ms + m.bwd_ms for m in found)
        spread = sum(m.spread * (m.fwd_ms + m.bwd_ms) for m in found) / total if total > 0 else 0.0
        return any(self.busy(m) for m in found), spread

    def speed(self) -> float:
        """The host's reference time now on a CPU (:attr:`reference`); 0 on a GPU or where it is not read."""
        return self.reference() if self.reference is not None and torch.device(self.device).type == "cpu" else 0.0

    def __post_init__(self) -> None:
        if not self.batches or min(self.batches) < 1 or min(self.fit_to, default=1) < 1:
            raise DeeppoolError("profile batch sizes must be >= 1")
        if self.repeats < 1 or self.warmup < 0:
            raise DeeppoolError("--repeats must be >= 1 and --warmup >= 0")
        if self.max_repeats < self.repeats or self.spread_bound <= 0 or self.retries < 0:
            raise DeeppoolError("the most repeats must be >= --repeats, the spread bound > 0 and the retries >= 0")
        if self.device.startswith("cuda") and not CudaGpu().available():
            raise DeeppoolError(f"--device {self.device}: no CUDA device here; use --device cpu or a device model")


@dataclass(frozen=True, kw_only=True)
class Measured:
    """One layer at one batch: median forward and backward ms of the kept runs, their relative spread,
    and the highest load seen while they ran (:attr:`ProfilerConfig.load`)."""

    fwd_ms: float
    bwd_ms: float
    spread: float
    load: float = 0.0
    reference_ms: float = 0.0
    """The host's reference time around the measurement (:func:`reference_ms`, the mean of the readings
    before and after); 0: not read."""
    speed_change: float = 0.0
    """How far the reference moved between those readings (a share of the faster)."""


CACHE_FILE = "layer-times.json"
CACHE_SCHEMA_VERSION = 2
"""Version 2: every entry records what it was measured under; older files are not read (not trusted)."""


class ProfileCache:
    """A JSON file of measurements by measurement key, written as it fills (at most once per ``every_s``).

    Each entry holds the medians, their spread and the conditions of the measurement: load,
    cores, intra-op threads, torch's version, the device and when."""

    def __init__(self, directory: Path, every_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = directory / CACHE_FILE
        self.entries: dict[str, dict[str, object]] = {}
        self._every_s, self._clock = every_s, clock
        self._saved_at = clock()
        if self.path.is_file():
            try:
                payload = json.loads(self.path.read_text())
            except json.JSONDecodeError:
                payload = {}
            if isinstance(payload, dict) and payload.get("schema_version") == CACHE_SCHEMA_VERSION:
                self.entries = dict(payload.get("entries") or {})

    def get(self, key: str) -> Measured | None:
        found = self.entries.get(key)
        if not isinstance(found, dict):
            return None
        try:
            return Measured(fwd_ms=float(found["fwd_ms"]), bwd_ms=float(found["bwd_ms"]),
                            spread=float(found["spread"]), load=float(found["load"]),
                            reference_ms=float(found.get("reference_ms", 0.0)),
                            speed_change=float(found.get("speed_change", 0.0)))
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, key: str, measured: Measured, conditions: dict[str, object] | None = None) -> None:
        self.entries[key] = {**asdict(measured), **(conditions or {}), "at": time.time()}
        if self._clock() - self._saved_at >= self._every_s:
            self.save()

    def save(self) -> None:
        write_json(self.path, {"schema_version": CACHE_SCHEMA_VERSION, "entries": self.entries})
        self._saved_at = self._clock()


def clear_cache(directory: Path) -> int:
    """Remove the layer-time cache in ``directory``; the number of entries it held (0: there was none)."""
    path = directory / CACHE_FILE
    if not path.is_file():
        return 0
    count = len(ProfileCache(directory).entries)
    path.unlink()
    return count


def device_name(device: torch.device) -> str:
    gpu = gpu_for(device)
    if gpu is not None:
        return gpu.name(device).replace(" ", "-").lower()
    return f"cpu-{os.cpu_count()}c-{torch.get_num_threads()}t"


def device_memory(device: torch.device) -> int:
    gpu = gpu_for(device)
    if gpu is not None:
        return gpu.total_memory(device)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_budget(device: torch.device) -> int:
    """Bytes a profiling pass may take: most of the device's free memory, and at most half a CPU host's memory
    (others share it)."""
    gpu = gpu_for(device)
    if gpu is not None:
        return int(0.8 * gpu.free_memory(device))
    return int(min(0.5 * device_memory(device), 0.8 * _available_memory()))


def _available_memory() -> int:
    """The host's available memory (MemAvailable), or its free pages where /proc/meminfo is absent."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


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
    """Measure every layer of ``traced`` at ``config.batches`` on ``config.device``; fit the rest."""
    profiler = LayerProfiler(traced, loaded, config)
    profiler.measure(config.batches)
    return profiler.profile(config.fit_to)


class LayerProfiler:
    """Measures a traced model's layers at per-GPU batches as they are asked for, and keeps them: a
    planner that finds its plan uses a batch not measured yet asks for it (:meth:`measure`) and builds
    a new profile (:meth:`profile`) without measuring anything twice."""

    def __init__(self, traced: Traced, loaded: LoadedModel, config: ProfilerConfig) -> None:
        self.traced, self.loaded, self.config = traced, loaded, config
        self.device = torch.device(config.device)
        traced.module.to(self.device)
        graph = traced.graph
        self.measured: dict[str, dict[int, Measured]] = {name: {} for name in (*graph.names, LOSS)}
        random = traced.random.mode(seed=0) if traced.random else None
        drawing = (traced.random, random) if random is not None else None
        self.passes = Passes(module=traced.module, graph=graph, runners=runners(traced.module, graph.layers, drawing),
                             device=self.device, random=random)
        self.whole: dict[int, WholePass] = {}
        """By measured batch: the whole pass its layer times were scaled to."""
        self.grouped: dict[str, dict[int, Measured]] = {}
        """The batch-normalising layers' times as they run on ``g > 1`` ranks (:mod:`~deeppool.planner.group_times`)."""
        self.code = {layer.name: layer_code(traced.module, layer) for layer in graph.layers}
        self._early_sharing: dict[int, float] | None = None
        """The cores' sharing as measuring began (:meth:`_sharing`)."""
        if self.device.type == "cpu":
            steady_allocator()

    @property
    def batches(self) -> tuple[int, ...]:
        """The per-GPU batches measured so far."""
        return tuple(sorted(self.measured[LOSS]))

    def fits(self, batch: int) -> bool:
        """Whether a training pass of the whole model at ``batch`` fits the memory free here for measuring:
        its stored activations and their gradients (three times the traced per-sample bytes, as a bound) and
        weights, gradients and momenta, within :func:`memory_budget` (a plan runs a layer at a batch on its
        own ranks; measuring it runs every layer at that batch)."""
        graph = self.traced.graph
        needed = 3 * batch * sum(layer.act_bytes for layer in graph.layers) + \
            4 * sum(layer.param_bytes for layer in graph.layers)
        budget = self.config.memory_budget
        return needed <= (memory_budget(self.device) if budget is None else budget)

    def measure(self, batches: Iterable[int]) -> None:
        """Measure every layer (and the loss) at each of ``batches`` not measured yet (from the cache where
        it holds them and may be trusted)."""
        config, graph = self.config, self.traced.graph
        new = sorted(set(batches) - set(self.batches), reverse=True)  # the largest first: the rest reuse its memory
        if not new:
            return
        cache = ProfileCache(config.cache_dir) if config.cache_dir else None
        if self._early_sharing is None:
            self._early_sharing = self._measure_sharing()
        try:
            with intra_op_threads(config.threads), \
                    Progress(disable=not config.show_progress, transient=True) as progress:
                task = progress.add_task(f"profiling on {device_name(self.device)} at per-GPU batches {new}",
                                         total=len(new) * (len(graph) + 1))
                for batch in new:
                    self._keep(batch, self._steadiest(batch, cache))
                    self._measure_grouped(batch)
                    progress.advance(task, len(graph) + 1)
        finally:
            if cache:
                cache.save()
            for parameter in self.traced.module.parameters():
                parameter.grad = None  # timing the backward passes left gradients behind

    def _steadiest(self, batch: int, cache: ProfileCache | None) -> dict[str, Measured]:
        """``batch`` measured (:func:`_measure_batch`), and again while the host's speed moved under the
        measurement and the machine is not busy, up to ``config.retries`` times: the steadiest attempt."""
        config = self.config
        best = dict(_measure_batch(self, batch, cache))
        for _ in range(config.retries):
            if not any(m.speed_change > config.speed_bound for m in best.values()) or config.load() > config.cores:
                break
            attempt = dict(_measure_batch(self, batch, cache))
            if config.noise(attempt.values()) < config.noise(best.values()):
                best = attempt
        return best

    def _keep(self, batch: int, samples: dict[str, Measured]) -> None:
        """Keep ``batch``'s measurements: the layers' times scaled to the whole pass (:class:`WholePass`)."""
        names = self.traced.graph.names
        whole = samples.pop(WHOLE)
        scale = self.whole[batch] = WholePass(fwd_ms=whole.fwd_ms, bwd_ms=whole.bwd_ms,
                                              layer_fwd_ms=sum(samples[name].fwd_ms for name in names),
                                              layer_bwd_ms=sum(samples[name].bwd_ms for name in names))
        for name, sample in samples.items():
            self.measured[name][batch] = sample if name == LOSS else \
                replace(sample, fwd_ms=sample.fwd_ms * scale.fwd_ratio, bwd_ms=sample.bwd_ms * scale.bwd_ratio)

    @cached_property
    def _grouped_layers(self) -> GroupedLayers:
        return GroupedLayers.of(self.traced.module, self.traced.graph, self.passes.runners)

    @cached_property
    def _same_code(self) -> dict[str, str]:
        """Every layer's code without its submodules' paths: layers alike in it and in their arguments'
        shapes have one grouped-over-fused ratio."""
        return {layer.name: layer_code(self.traced.module, layer, by_path=False) for layer in self.traced.graph.layers}

    def _measure_grouped(self, batch: int) -> None:
        """The batch-normalising layers' in-context times at ``batch`` scaled by their grouped-over-fused ratios."""
        ratios = self._grouped_layers.ratios(_inputs(self, batch), batch, lambda work: _timed(self.device, work),
                                             self._same_code)
        for name, ratio in ratios.items():
            fused = self.measured[name][batch]
            self.grouped.setdefault(name, {})[batch] = replace(fused, fwd_ms=fused.fwd_ms * ratio.fwd,
                                                               bwd_ms=fused.bwd_ms * ratio.bwd)

    def conditions(self) -> Conditions:
        """What the measurements so far were taken under (the highest load among them)."""
        loads = [m.load for samples in self.measured.values() for m in samples.values()]
        return Conditions(load=max(loads, default=self.config.load()), cores=self.config.cores,
                          threads=self.config.threads, torch=torch.__version__, device=device_name(self.device))

    def entry(self) -> dict[str, object]:
        """The conditions a cache entry records beside its figures."""
        return {"cores": self.config.cores, "threads": self.config.threads, "torch": torch.__version__,
                "device": device_name(self.device)}

    def profile(self, fit_to: Iterable[int] = ()) -> Profile:
        """The profile of what was measured: measured times at the measured batches, the fitted line at the
        other batches of ``fit_to``."""
        config, graph, device = self.config, self.traced.graph, self.device
        batches = self.batches
        if not batches:
            raise DeeppoolError("nothing measured yet: measure some per-GPU batches first")
        targets = tuple(sorted(set(batches) | set(fit_to)))
        ordered = {name: [samples[b] for b in batches] for name, samples in self.measured.items()}
        losses = ordered.pop(LOSS)
        loss = layer_times(batches, losses, targets, config.untrusted)[0]
        layers = {name: layer_times(batches, samples, targets, config.untrusted) for name, samples in ordered.items()}
        grouped = {name: layer_times(batches, [samples[b] for b in batches], targets, config.untrusted)[0]
                   for name, samples in self.grouped.items() if all(b in samples for b in batches)}
        overhead, bandwidth, sharing = self._device_figures
        return Profile(
            device=device_name(device),
            source="measured",
            dtype=graph.layers[0].dtype if graph.layers else "float32",
            memory_bytes=device_memory(device),
            memory_bandwidth=bandwidth,
            layers={name: times for name, (times, _) in layers.items()},
            grouped=grouped,
            fit=_quality(batches, [errors for _, errors in layers.values()], ordered, config.spread_bound),
            concurrent_ranks=_concurrent_ranks(device, config.threads),
            measured_sharing=sharing,
            step_overhead=overhead,
            loss=loss,
            conditions=self.conditions(),
            whole_pass={batch: self.whole[batch] for batch in batches if batch in self.whole},
        )

    @cached_property
    def _device_figures(self) -> tuple[dict[str, StepOverhead], float, dict[int, float]]:
        """The optimizer's step overhead, the memory bandwidth (with a rank's threads, as its optimizer
        steps) and, on a CPU, how ranks share the cores: measured once per profiler."""
        config = self.config
        with intra_op_threads(config.threads):
            overhead = measure_step_overhead(self.device)
            bandwidth = memory_bandwidth(self.device)
            if self.batches:
                batch = self._step_batch()
                overhead = measure_model_step(self.passes, _inputs(self, batch), batch, overhead, bandwidth)
        return overhead, bandwidth, self._sharing()

    def _step_batch(self) -> int:
        """The batch :func:`measure_model_step` runs its passes at: the largest measured one whose passes for
        it take at most ``STEP_BUDGET_MS`` (a larger backward leaves less of the parameters in the caches, as a
        training step's does), else the smallest."""
        passes = len(Optimizer) * (STEP_WARMUP + STEP_REPEATS)
        fitting = [batch for batch in self.batches if batch in self.whole
                   and passes * (self.whole[batch].fwd_ms + self.whole[batch].bwd_ms) <= STEP_BUDGET_MS]
        return max(fitting, default=self.batches[0])

    def _measure_sharing(self) -> dict[int, float]:
        """How ranks share the cores (:func:`measure_sharing`), on a CPU profile planned for ranks; else none."""
        config = self.config
        return measure_sharing(sharing_counts(config.ranks), config.threads or 1) \
            if self.device.type == "cpu" and config.ranks else {}

    def _sharing(self) -> dict[int, float]:
        """The cores' sharing measured twice, as measuring began and after it, the lower of the two at each
        count: a slow stretch of the host only adds to it, and one through a whole measurement once read 1.33
        where the model's other plans read 1.01-1.06 (its plan predicted 1.25x its run, ``docs/performance.md``)."""
        later = self._measure_sharing()
        early = self._early_sharing or {}
        return {g: min(share, early.get(g, share)) for g, share in later.items()}


STEP_REPEATS, STEP_WARMUP = 5, 1
"""The timed and untimed steps per optimizer of :func:`measure_model_step`, each after a whole pass."""
STEP_BUDGET_MS = 1500.0
"""What :func:`measure_model_step`'s passes may take at the batch chosen for them (:meth:`LayerProfiler._step_batch`)."""
LOSS = "<loss>"
"""The loss function's key among the measured entries (no layer name has angle brackets)."""
WHOLE = "<whole pass>"
"""The whole pass's key among one batch's measured entries (:meth:`Passes.whole`)."""


def measure_step_overhead(device: torch.device, repeats: int = 15, tensors: int = 33) -> dict[str, StepOverhead]:
    """Each optimizer's step beyond its memory traffic: ``step()`` then ``zero_grad(set_to_none=True)``
    (as the executor steps) over 1 and over ``tensors`` tiny parameters, the median of ``repeats``;
    the difference per extra tensor is the per-tensor cost, the rest the per-call cost."""
    found = {}
    for optimizer in Optimizer:
        one, many = (_step_ms(optimizer, device, count, repeats) for count in (1, tensors))
        per_tensor = max(0.0, (many - one) / (tensors - 1))
        found[optimizer.value] = StepOverhead(call_ms=max(0.0, one - per_tensor), per_tensor_ms=per_tensor)
    return found


def _step_ms(optimizer: Optimizer, device: torch.device, count: int, repeats: int) -> float:
    params = [torch.nn.Parameter(torch.zeros(16, device=device)) for _ in range(count)]
    step = _optimizer(optimizer, params, lr=1e-3)

    def once() -> float:
        for param in params:
            param.grad = torch.zeros_like(param)
        return _timed(device, lambda: (step.step(), step.zero_grad(set_to_none=True)))[0]

    for _ in range(3):
        once()
    return statistics.median(once() for _ in range(repeats))


def _optimizer(optimizer: Optimizer, params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """The executor's optimizer of this kind (SGD without momentum, Adam) over ``params``."""
    return torch.optim.Adam(params, lr=lr) if optimizer is Optimizer.ADAM else torch.optim.SGD(params, lr=lr)


def measure_model_step(passes: Passes, inputs: dict[str, torch.Tensor], batch: int,
                       overhead: dict[str, StepOverhead], bandwidth: float, repeats: int = STEP_REPEATS,
                       warmup: int = STEP_WARMUP) -> dict[str, StepOverhead]:
    """``overhead`` with each optimizer's ``per_megabyte_ms``: its ``step()`` and ``zero_grad(set_to_none=True)``
    over the model's own parameters right after a whole pass's backward (as a one-stage executor steps), the
    median of ``repeats``, beyond what the tiny tensors' overhead and the memory traffic at ``bandwidth`` price,
    per megabyte of parameters. On tiny warm tensors a step prices only streaming its bytes; after a backward
    the zoo's CNNs stepped 0.19-0.23 ms per MB slower on this CPU, and their runs' steps took twice the
    prediction (``docs/planner.md``, ``OPT_l``). The steps run at learning rate 0: the weights stay as they are."""
    params = [param for param in passes.module.parameters() if param.requires_grad]
    found = dict(overhead)
    for optimizer in Optimizer:
        step = _optimizer(optimizer, params, lr=0.0)
        times, stepped = [], []
        for index in range(warmup + repeats):
            passes.whole(inputs, batch=batch)
            stepped = [param for param in params if param.grad is not None]
            ms = _timed(passes.device, lambda s=step: (s.step(), s.zero_grad(set_to_none=True)))[0]
            if index >= warmup:
                times.append(ms)
        megabytes = sum(param.numel() * param.element_size() for param in stepped) / 1e6
        if megabytes <= 0:
            continue
        base = overhead.get(optimizer.value, StepOverhead())
        streamed = 1e3 * optimizer.step_traffic(megabytes * 1e6) / bandwidth
        beyond = statistics.median(times) - base.call_ms - base.per_tensor_ms * len(stepped) - streamed
        found[optimizer.value] = replace(base, per_megabyte_ms=max(0.0, beyond / megabytes))
    return found


def sharing_counts(ranks: int | None) -> tuple[int, ...]:
    """The rank counts whose core sharing is measured: powers of two from 2, and ``ranks`` itself,
    up to twice the cores (beyond, time-slicing is linear: :meth:`Profile.sharing` extrapolates)."""
    if not ranks or ranks < 2:
        return ()
    top = min(ranks, 2 * (os.cpu_count() or 1))
    return tuple(sorted({2**k for k in range(1, top.bit_length()) if 2**k <= top} | {top}))


def measure_sharing(counts: tuple[int, ...], threads: int, repeats: int = 5, matmuls: int = 250) -> dict[int, float]:
    """``sharing(g)`` for each ``g`` of ``counts``: the slowest of ``g·threads`` single-threaded workers
    doing the same fixed work at once over ``threads`` of them alone, measured in turns (alone, then
    together) so that other work on the host, which comes and goes, weighs on both alike; the median
    of ``repeats`` turns (one turn's figure reaches 1.24-1.28 one time in ten on a calm 2-core VM whose
    median is 1.03-1.04, ``benchmarks/core_sharing.py``: the median of five reaches it about once in a
    hundred, of three three times as often).

    Workers are threads of this process: a matmul with one intra-op thread runs on its caller with
    the GIL released, so they compete for the cores as ranks (processes) do."""
    with intra_op_threads(1):
        _concurrent_work(threads, matmuls)  # warm-up
        return {
            g: statistics.median(
                _concurrent_work(g * threads, matmuls) / _concurrent_work(threads, matmuls) for _ in range(repeats)
            )
            for g in counts
        }


def _concurrent_work(workers: int, matmuls: int) -> float:
    """Seconds until the last of ``workers`` threads has done ``matmuls`` 256×256 matmuls, all started together.

    Interrupted (Ctrl-C), it stops its threads and waits until each has finished before the interrupt goes on:
    a thread still in a matmul as the interpreter exits aborted the process (``terminate called without an
    active exception``) where the command should say ``interrupted`` and exit 130. It waits on events the
    threads set, since a ``join`` that Ctrl-C interrupted marks its thread stopped while it still runs
    (CPython 3.11)."""
    matrix = torch.randn(256, 256)
    start, stop = threading.Barrier(workers), threading.Event()
    done = [threading.Event() for _ in range(workers)]
    finished: list[float] = []

    def work(mine: threading.Event) -> None:
        try:
            torch.set_num_threads(1)  # OpenMP's thread count is per calling thread
            torch.mm(matrix, matrix)
            start.wait()
            began = time.perf_counter()
            for _ in range(matmuls):
                if stop.is_set():
                    return
                torch.mm(matrix, matrix)
            finished.append(time.perf_counter() - began)
        except threading.BrokenBarrierError:
            return
        finally:
            mine.set()

    pool = [threading.Thread(target=work, args=(event,)) for event in done]
    try:
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
    except BaseException:
        stop.set()
        start.abort()
        for thread, event in zip(pool, done, strict=True):
            if thread.ident is not None:
                event.wait()
        raise
    return max(finished)


def _concurrent_ranks(device: torch.device, threads: int | None) -> int | None:
    """On a CPU, the ranks that fit the host's cores with the intra-op threads measured with."""
    if device.type != "cpu":
        return None
    return max(1, (os.cpu_count() or 1) // (threads or torch.get_num_threads()))


@contextmanager
def intra_op_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` intra-op threads (unchanged for None), then restore them."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def fit_line(xs: tuple[int, ...], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b·x`` with ``a, b ≥ 0`` (through the origin from a single point)."""
    if len(xs) == 1:
        return 0.0, max(ys[0], 0.0) / xs[0]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    intercept = mean_y - slope * mean_x
    if slope < 0:
        return max(mean_y, 0.0), 0.0
    if intercept < 0:
        return 0.0, max(sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs), 0.0)
    return intercept, slope


def fit_layer(
    batches: tuple[int, ...], samples: list[Measured], targets: tuple[int, ...]
) -> tuple[LayerTimes, list[float]]:
    """A layer's fitted times at ``targets``, and the fit's relative errors at the measured points."""
    fits = [fit_line(batches, [getattr(s, name) for s in samples]) for name in ("fwd_ms", "bwd_ms")]
    errors = []
    for batch, sample in zip(batches, samples, strict=True):
        total = sample.fwd_ms + sample.bwd_ms
        predicted = sum(a + b * batch for a, b in fits)
        if total >= _NOISE_FLOOR_MS:
            errors.append(abs(predicted - total) / total)
    times = LayerTimes(
        batches=targets,
        fwd_ms=tuple(fits[0][0] + fits[0][1] * t for t in targets),
        bwd_ms=tuple(fits[1][0] + fits[1][1] * t for t in targets),
    )
    return times, errors


_NOISE_FLOOR_MS = 0.05
"""Layers faster than this at a batch are timer noise; the fit's error ignores them."""


def layer_times(
    batches: tuple[int, ...], samples: list[Measured], targets: tuple[int, ...],
    untrusted: Callable[[Measured], bool] = lambda _: False,
) -> tuple[LayerTimes, list[float]]:
    """A layer's times at ``targets``: the measured medians at the measured batches (the fitted line where
    the layer is below the timer's noise floor, and at the other targets), each with the spread of the
    measurement it rests on (the nearest measured batch's at a fitted one) and whether that measurement
    is ``untrusted``; the per-sample time never falls as the batch shrinks. Also the fit's relative errors."""
    fitted, errors = fit_layer(batches, samples, targets)
    by_batch = dict(zip(batches, samples, strict=True))
    fwd, bwd, spread, busy = [], [], [], []
    for index, target in enumerate(targets):
        sample = by_batch.get(target)
        near = by_batch[min(batches, key=lambda b: (abs(b - target), b))]
        if sample is not None and sample.fwd_ms + sample.bwd_ms >= _NOISE_FLOOR_MS:
            fwd.append(sample.fwd_ms)
            bwd.append(sample.bwd_ms)
        else:
            fwd.append(fitted.fwd_ms[index])
            bwd.append(fitted.bwd_ms[index])
        spread.append(near.spread)
        busy.append(untrusted(near))
    _keep_gpu_time(targets, fwd, bwd)
    return LayerTimes(batches=targets, fwd_ms=tuple(fwd), bwd_ms=tuple(bwd), spread=tuple(spread),
                      busy=tuple(busy)), errors


def _keep_gpu_time(batches: tuple[int, ...], fwd: list[float], bwd: list[float]) -> None:
    """Raise, in place, a time whose per-sample rate is below a larger batch's: on ``g`` GPUs a layer then
    never costs less GPU-time than on one (``g · t(⌈B/g⌉) ≥ t(B)``), whatever noise the medians carry."""
    floor = 0.0
    for index in reversed(range(len(batches))):
        total = fwd[index] + bwd[index]
        least = floor * batches[index]
        if total < least:
            if total > 0:
                fwd[index], bwd[index] = fwd[index] * least / total, bwd[index] * least / total
            else:
                fwd[index], bwd[index] = least / 2, least / 2
        floor = max(floor, (fwd[index] + bwd[index]) / batches[index])


def _quality(
    batches: tuple[int, ...], errors: list[list[float]], measured: dict[str, list[Measured]], bound: float
) -> FitQuality:
    flat = sorted(e for layer in errors for e in layer)
    spreads = [sample.spread for samples in measured.values() for sample in samples]
    return FitQuality(
        measured_batches=batches,
        error_p50=flat[len(flat) // 2] if flat else 0.0,
        error_p90=flat[min(int(0.9 * len(flat)), len(flat) - 1)] if flat else 0.0,
        noisy=sum(spread > bound for spread in spreads),
        measurements=len(spreads),
        spread_bound=bound,
        compared=len(flat),
    )


@dataclass(frozen=True, kw_only=True)
class Passes:
    """Runs whole training passes of a model layer by layer, timing each layer's forward and backward."""

    module: torch.nn.Module
    graph: LayerGraph
    runners: dict[str, LayerRunner]
    device: torch.device
    random: SampleRandomness | None = None
    """The per-sample randomness mode the executor's forwards run under, for a model that draws random numbers
    (every op then passes through it, and each random op draws sample by sample): the forwards are timed
    under it too."""

    @cached_property
    def flows(self) -> dict[str, bool]:
        """Which layers' outputs take gradients (:func:`grad_flows`), once per model."""
        return grad_flows(self.graph)

    @cached_property
    def last_use(self) -> dict[str, int]:
        """By value name: the index of the last layer that reads it (a forward drops it after that layer)."""
        return {name: index for index, layer in enumerate(self.graph.layers) for name in layer.inputs}

    def drawing(self) -> AbstractContextManager[object]:
        """The context a forward runs in: the per-sample randomness mode from its first draw, or nothing."""
        return self.random.at(step=0, offset=0, ordinal=0) if self.random is not None else nullcontext()

    def run(self, inputs: dict[str, torch.Tensor], *, batch: int, keep: frozenset[str] = frozenset()
            ) -> tuple[dict[str, float], dict[str, float], dict[str, object]]:
        """One pass: every layer's forward in order, then every backward in reverse, each on its own
        leaves (as the executor's stages: inputs take gradients where :func:`grad_flows` says, the
        gradients of a layer's output summed over its consumers); (fwd_ms, bwd_ms) by layer, and the
        values of the layers in ``keep`` (each other value and gradient is dropped once its backward
        has run, so a pass holds what a training step holds). A layer whose forward or backward raises at
        this per-GPU ``batch`` is a :class:`LayerFailed` naming it."""
        flows = self.flows
        for param in self.module.parameters():
            param.grad = None  # the executor's optimizer steps with zero_grad(set_to_none=True)
        values: dict[str, object] = dict(inputs)
        leaves: dict[tuple[str, str], torch.Tensor] = {}
        fwd: dict[str, float] = {}
        with self.drawing():
            for layer in self.graph.layers:
                args = []
                for name in layer.inputs:
                    value = values[name]
                    leaf = value.detach().requires_grad_(flows.get(name, False) and value.is_floating_point())
                    leaves[(layer.name, name)] = leaf
                    args.append(leaf)
                fwd[layer.name], values[layer.name] = _timed(
                    self.device, lambda r=self.runners[layer.name], a=args: run_at(r, a, batch))
        grads: dict[str, torch.Tensor] = {}
        bwd: dict[str, float] = {}
        for layer in reversed(self.graph.layers):
            value = values[layer.name] if layer.name in keep else values.pop(layer.name)
            bwd[layer.name] = self._backward(layer, value, grads, batch)
            del value
            for name in layer.inputs:
                grad = leaves.pop((layer.name, name)).grad
                if name in self.runners and grad is not None:
                    grads[name] = grads[name] + grad if name in grads else grad
        return fwd, bwd, {name: values[name] for name in keep}

    def whole(self, inputs: dict[str, torch.Tensor], *, batch: int) -> tuple[float, float]:
        """One pass as a one-stage executor runs it: the layers' forwards chained (no leaves between them,
        each value dropped after its last use), then one backward from ones at the output; (fwd_ms, bwd_ms)."""
        for param in self.module.parameters():
            param.grad = None
        graph, last_use = self.graph, self.last_use

        def forward() -> object:
            values: dict[str, object] = dict(inputs)
            for index, layer in enumerate(graph.layers):
                values[layer.name] = run_at(self.runners[layer.name], [values[name] for name in layer.inputs], batch)
                for name in layer.inputs:
                    if last_use[name] == index:
                        values.pop(name, None)
            return values[graph.output]

        with self.drawing():
            fwd_ms, output = _timed(self.device, forward)
        outputs = floating_leaves(output)
        if not outputs:
            return fwd_ms, 0.0
        return fwd_ms, _timed(self.device, lambda: torch.autograd.backward(outputs, [torch.ones_like(t)
                                                                                       for t in outputs]))[0]

    def _backward(self, layer: Layer, value: object, grads: dict[str, torch.Tensor], batch: int) -> float:
        """The layer's backward from the gradients its consumers sent (ones for the model's output); a
        backward that raises (an op needing more samples than ``batch``) is a :class:`LayerFailed`."""
        outputs = floating_leaves(value)
        if layer.name == self.graph.output and layer.name not in grads:
            gradients = [torch.ones_like(t) for t in outputs]
        elif layer.name in grads and isinstance(value, torch.Tensor) and value.requires_grad:
            outputs, gradients = [value], [grads.pop(layer.name)]
        else:
            return 0.0
        if not outputs:
            return 0.0
        try:
            return _timed(self.device, lambda: torch.autograd.backward(outputs, gradients))[0]
        except DeeppoolError:
            raise
        except Exception as err:  # noqa: BLE001  any backward of the user's model: named, with its layer and batch
            raise LayerFailed(layer, None, batch, err) from None


def _measure_batch(profiler: LayerProfiler, batch: int, cache: ProfileCache | None) -> Iterator[tuple[str, Measured]]:
    """(layer, measured) for every layer at ``batch``, then the loss: whole passes (``config.warmup``
    untimed, then rounds of ``config.repeats``) until every layer above the timer's noise floor has a
    spread within the bound, or ``config.max_repeats`` passes; each layer's medians over its kept passes,
    with the highest load seen. From the cache when every layer at this batch is there, unless
    some of it is untrusted and the machine is not busy now (:meth:`ProfilerConfig.remeasure`): then the
    batch is measured again, and the steadier of the two measurements is kept (:meth:`ProfilerConfig.noise`),
    so one unlucky draw does not stay in the cache while the machine is as loaded as it was."""
    passes, config = profiler.passes, profiler.config
    graph = passes.graph
    inputs = _inputs(profiler, batch)
    keys, output = _keys(profiler, inputs, batch)
    whole_key = hashlib.sha256("|".join((WHOLE, *keys.values())).encode()).hexdigest()
    found = {name: cache.get(key) for name, key in (*keys.items(), (WHOLE, whole_key))} if cache else {}
    cached = {name: m for name, m in found.items() if m is not None}
    before = config.speed()
    if cached and len(cached) == len(keys) + 1 and not config.remeasure(cached.values(), before):
        yield from cached.items()
        yield LOSS, _measure_loss(profiler, output, batch, cache, before)
        return
    load = config.load()
    for _ in range(config.warmup):
        passes.run(inputs, batch=batch)
    runs: list[tuple[dict[str, float], dict[str, float]]] = []
    while True:
        for _ in range(config.repeats):
            fwd, bwd, _ = passes.run(inputs, batch=batch)
            runs.append((fwd, bwd))
        load = max(load, config.load())
        measured = {name: _summary([f[name] for f, _ in runs], [b[name] for _, b in runs], load)
                    for name in graph.names}
        settled = all(m.spread <= config.spread_bound or m.fwd_ms + m.bwd_ms < _NOISE_FLOOR_MS
                      for m in measured.values())
        if settled or len(runs) + config.repeats > config.max_repeats:
            break
    measured[WHOLE] = _measure_whole(passes, inputs, batch, config, load)
    speed = _speed(before, config.speed())
    measured = {name: replace(sample, **speed) for name, sample in measured.items()}
    same_speed = not any(config.moved(m, speed["reference_ms"]) for m in cached.values())
    if len(cached) == len(measured) and same_speed and config.noise(cached.values()) < config.noise(measured.values()):
        measured = cached  # the cached measurement, at this speed, was the steadier one: kept
    elif cache:
        for name, sample in measured.items():
            cache.put(whole_key if name == WHOLE else keys[name], sample, profiler.entry())
    yield from measured.items()
    yield LOSS, _measure_loss(profiler, output, batch, cache, speed["reference_ms"])


def _speed(before_ms: float, after_ms: float) -> dict[str, float]:
    """:class:`Measured`'s host-speed fields from the reference read before and after (0: not read)."""
    read = before_ms > 0 and after_ms > 0
    return {"reference_ms": (before_ms + after_ms) / 2 if read else 0.0, "speed_change": _change(before_ms, after_ms)}


def _change(first_ms: float, second_ms: float) -> float:
    """How far two reference readings are apart, as a share of the faster; 0 where either was not read."""
    if first_ms <= 0 or second_ms <= 0:
        return 0.0
    return abs(first_ms - second_ms) / min(first_ms, second_ms)


def _measure_whole(passes: Passes, inputs: dict[str, torch.Tensor], batch: int, config: ProfilerConfig,
                   load: float) -> Measured:
    """The whole pass's medians (:meth:`Passes.whole`) over ``config.repeats`` passes after the warm-up ones.

    The warm-up stays although the layer-by-layer passes just ran the same kernels: without it the held-out
    transformers' 2-rank predictions fell 5-25% below the run (``docs/performance.md``)."""
    timed = [passes.whole(inputs, batch=batch) for _ in range(config.warmup + config.repeats)][config.warmup:]
    return _summary([f for f, _ in timed], [b for _, b in timed], max(load, config.load()))


def _inputs(profiler: LayerProfiler, batch: int) -> dict[str, torch.Tensor]:
    """The model's inputs at ``batch`` on the profiling device, by graph input (a dict binds by name, as the
    graph's input keys record)."""
    graph, named = profiler.traced.graph, profiler.loaded.named_inputs(batch)
    return {name: named[key].to(profiler.device) for name, key in zip(graph.inputs, graph.input_keys, strict=True)}


def _keys(profiler: LayerProfiler, inputs: dict[str, torch.Tensor], batch: int) -> tuple[dict[str, str], object]:
    """Every layer's cache key, from the shapes of its inputs in one untimed forward (a warm-up), and the
    model's output (what the loss is timed on)."""
    passes = profiler.passes
    graph = passes.graph
    last_use = passes.last_use
    values: dict[str, object] = dict(inputs)
    keys = {}
    with torch.no_grad():
        for index, layer in enumerate(graph.layers):
            args = [values[name] for name in layer.inputs]
            keys[layer.name] = _key(layer, profiler.code[layer.name], args, batch, passes.device, profiler.config)
            values[layer.name] = run_at(passes.runners[layer.name], args, batch)  # LayerFailed: not measurable here
            for name in layer.inputs:
                if last_use[name] == index:
                    values.pop(name, None)
    return keys, values[graph.output]


def _summary(fwd: list[float], bwd: list[float], load: float) -> Measured:
    """Medians of the passes kept (outliers in forward+backward dropped), their spread, the load seen."""
    totals = [f + b for f, b in zip(fwd, bwd, strict=True)]
    kept = _inliers(totals)
    return Measured(fwd_ms=statistics.median(fwd[i] for i in kept), bwd_ms=statistics.median(bwd[i] for i in kept),
                    spread=_spread([totals[i] for i in kept]), load=load)


def _measure_loss(profiler: LayerProfiler, output: object, batch: int, cache: ProfileCache | None,
                  reference: float) -> Measured:
    """The loss function on the output layer's value at ``batch`` (targets from the model's own
    ``targets``): forward, then backward from the loss, as the executor's loss op and backward run it;
    ``reference``: the host's reference time now (its batch's, :func:`reference_ms`)."""
    loaded, device, config = profiler.loaded, profiler.device, profiler.config
    targets = loaded.targets(batch)
    targets = None if targets is None else targets.to(device)
    leaves = [leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)]
    shapes = [(tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves]
    text = f"loss|{getattr(loaded.loss, '__qualname__', loaded.loss)}|{_source(loaded.loss)}|{shapes}|{batch}|" \
           f"{device_name(device)}|{torch.__version__}|{config.threads}"
    key = hashlib.sha256(text.encode()).hexdigest()
    found = cache.get(key) if cache else None
    if found is not None and not config.remeasure((found,), reference):
        return found
    load = config.load()
    fwd, bwd = [], []
    for repeat in range(config.warmup + max(config.repeats, 5)):
        value = pytree.tree_map(_fresh_leaf, output)
        forward_ms, loss = _timed(device, lambda v=value: loaded.loss(v, targets))
        backward_ms = _timed(device, loss.backward)[0] if isinstance(loss, torch.Tensor) and loss.requires_grad else 0.0
        if repeat >= config.warmup:
            fwd.append(forward_ms)
            bwd.append(backward_ms)
    totals = [f + b for f, b in zip(fwd, bwd, strict=True)]
    measured = Measured(fwd_ms=statistics.median(fwd), bwd_ms=statistics.median(bwd), spread=_spread(totals),
                        load=max(load, config.load()), reference_ms=reference)
    if cache:
        cache.put(key, measured, profiler.entry())
    return measured


def _fresh_leaf(value: object) -> object:
    """A floating tensor as a new leaf that takes gradients (the loss's backward starts there)."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().requires_grad_(True)
    return value


def _key(layer: Layer, code: str, args: list[object], batch: int, device: torch.device,
         config: ProfilerConfig) -> str:
    shapes = [(tuple(a.shape[1:]), str(a.dtype)) for a in args if isinstance(a, torch.Tensor)]
    text = (
        f"{layer.signature}|{code}|{shapes}|{batch}|{device_name(device)}|{torch.__version__}|{config.warmup}|"
        f"{config.repeats}|{config.max_repeats}|{config.spread_bound}|{config.threads}|in-context-passes|compiled|drawing-per-sample|whole-pass"
    )
    return hashlib.sha256(text.encode()).hexdigest()


def layer_code(module: fx.GraphModule, layer: Layer, *, by_path: bool = True) -> str:
    """A digest of the code a layer runs: each of its fx nodes (kind, target, constant arguments) and, for a
    module or a Python function, its class's or its own source and the module's settings; a change of the
    model's code changes it, so the cache never returns another code's times. ``by_path=False`` leaves out
    the submodules' paths: two layers that run the same code on different weights then have one digest."""
    by_name = {node.name: node for node in module.graph.nodes}
    parts = []
    for name in layer.nodes:
        node = by_name[name]
        constants = fx.node.map_arg((node.args, node.kwargs), lambda _: "%")
        target = node.target if by_path or node.op not in ("call_module", "get_attr") else ""
        parts.append(f"{node.op}|{target}|{constants!r}|{_target_code(module, node)}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _target_code(module: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        called = module.get_submodule(str(node.target))
        kind = type(called)
        return f"{kind.__module__}.{kind.__qualname__}({called.extra_repr()})|{_source(kind)}"
    if node.op == "call_function":
        return _source(node.target)
    return ""


def _source(code: object) -> str:
    """A digest of the source of a Python class or function ('' for a builtin or one without source)."""
    try:
        return _cached_source(code)
    except TypeError:  # unhashable: a callable object
        return ""


@cache
def _cached_source(code: object) -> str:
    try:
        return hashlib.sha256(inspect.getsource(code).encode()).hexdigest()[:16]  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ""


def _inliers(values: list[float]) -> list[int]:
    """Indices of the values within 3 scaled median absolute deviations of the median."""
    median = statistics.median(values)
    mad = 1.4826 * statistics.median(abs(v - median) for v in values)
    if mad == 0:
        return list(range(len(values)))
    return [i for i, v in enumerate(values) if abs(v - median) <= 3 * mad]


def _spread(values: list[float]) -> float:
    """The scaled median absolute deviation over the median of ``values`` (a robust relative spread)."""
    median = statistics.median(values)
    mad = 1.4826 * statistics.median(abs(v - median) for v in values)
    return mad / median if median > 0 else 0.0


def _timed(device: torch.device, work: Callable[[], object], gpu: Gpu | None = None) -> tuple[float, object]:
    """Milliseconds ``work`` takes: between two device events on a GPU (``gpu``: the seam, the real GPU
    of a CUDA ``device`` when not given), on the host clock on CPU."""
    gpu = gpu if gpu is not None else gpu_for(device)
    if gpu is not None:
        start, end = gpu.event(), gpu.event()
        start.record()
        result = work()
        end.record()
        end.synchronize()
        return start.elapsed_time(end), result
    began = time.perf_counter()
    result = work()
    return 1e3 * (time.perf_counter() - began), result
