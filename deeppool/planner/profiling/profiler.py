"""The per-layer profiler: forward and backward time of every layer, measured, then fitted.

Layers are timed in context, as they run in training: a *pass* runs every
layer's forward in order (:class:`CompiledLayerRunner`: generated code, as the executor runs a stage),
each on detached inputs that take gradients where the executor's do (not the model's inputs, nor outputs
no parameter feeds), then every layer's backward in reverse with the
gradient its consumers sent (:class:`Passes`), so a layer finds its input
activations and output gradient fresh in the cache and its weights and saved
activations evicted by the rest of the model, as it does in an iteration
(a layer timed alone in a loop finds its cache hot and runs faster than in
training: ``docs/notes/0001-profiler-times-what-the-executor-runs.md``).
Each per-GPU batch of ``batches`` gets ``warmup`` untimed passes, then timed
passes (``time.perf_counter`` on the CPU, CUDA events on a GPU) in rounds of
``repeats`` until every layer's spread over the kept passes (outliers beyond
3 scaled median absolute deviations, MAD, dropped; spread = scaled MAD over
the median) is within ``spread_bound`` (layers under the timer's noise floor
aside), or ``max_repeats`` passes were taken; a measurement still wider is
counted as noisy and the profile says how many there were. Each per-layer
split adds what a stage never pays (a leaf per input, one
``torch.autograd.backward`` call per layer, mostly in the backward:
``benchmarks/backward_split.py``), so ``repeats`` whole passes follow,
chained as a one-stage executor runs them (:meth:`Passes.whole`), and the
batch's layer times are scaled so that they add up to it
(:class:`~deeppool.planner.profiling.profile.WholePass`, kept in the profile). On the CPU
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
measured points is reported (:class:`~deeppool.planner.profiling.profile.FitQuality`),
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
by :mod:`deeppool.planner.profiling.hostload`, not the lagging 1-minute average), one
that stayed noisy, or one during which the host's speed changed is
*untrusted*: it is measured again whenever the machine is not busy, the
steadier of the two kept (a noisy draw does not stay in the cache while the
load is what it was), and otherwise kept but flagged (:attr:`LayerTimes.busy`),
so the plan names the layers resting on it.

**On a GPU**, a layer timed between events holds the host's time to issue it, which in training the host
hides by running ahead of the device (``docs/notes/0700-device-time-and-host-cost.md``). So each measured
batch's layers are also captured as graphs and replayed (:mod:`~deeppool.planner.profiling.devicetime`),
and the profile's layer times are their device times, its :attr:`~deeppool.planner.profiling.profile.Profile.host`
times their ops times the host's cost per op (measured once per host, torch and device, kept in the
cache folder): the cost model overlaps the two by the stage formula. A CPU profile has no host times (the
host is the device).

**The host's speed.** A shared host's speed can move without its load average
showing it, and a cache would then give a slow minute's times to every later
plan of the model (``docs/notes/0003-layer-time-cache-trust.md``). So a fixed
reference work (:func:`reference_ms`) is timed before and after each batch is
measured, and the cache records it beside the times: a batch whose reference
moved by more than ``speed_bound`` (20%) while it was measured is untrusted and measured again
right away (``retries``, twice at most, the steadiest attempt kept), and a
cached batch whose reference differs by more than ``reuse_bound`` (10%) from the
host's now is measured again and the new times kept (they are this speed's).
"""

from __future__ import annotations

import hashlib
import os
import statistics
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import torch
from rich.progress import Progress
from torch.utils import _pytree as pytree

from deeppool.device.cuda import CudaGpu, gpu_for
from deeppool.device.seam import Gpu
from deeppool.errors import DeeppoolError
from deeppool.model.allocator import steady_allocator
from deeppool.model.graph import Layer
from deeppool.model.layer_exec import run_at, runners
from deeppool.model.loading import LoadedModel
from deeppool.model.trace import Traced
from deeppool.plans import Optimizer
from deeppool.planner.profiling import sharing
from deeppool.planner.profiling.cache import ProfileCache, layer_code, source_digest
from deeppool.planner.profiling.devicetime import LayerCost, host_cost, measure_layers, with_device_time
from deeppool.planner.profiling.fitting import fit_quality, layer_times
from deeppool.planner.profiling.group_times import GroupedLayers
from deeppool.planner.profiling.hostload import runnable_now
from deeppool.planner.profiling.memory import device_memory, device_name, memory_bandwidth, memory_budget
from deeppool.planner.profiling.passes import Passes
from deeppool.planner.profiling.profile import Conditions, Profile, StepOverhead, WholePass
from deeppool.planner.profiling.stats import NOISE_FLOOR_MS, Measured, relative_spread, summary
from deeppool.planner.profiling.step import (
    STEP_BUDGET_MS,
    STEP_REPEATS,
    STEP_WARMUP,
    measure_model_step,
    measure_step_overhead,
)
from deeppool.planner.profiling.timing import intra_op_threads, reference_ms, timed


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
    """How busy the host is now, on the load average's scale (:func:`deeppool.planner.profiling.hostload.runnable_now`:
    the tasks runnable now, this process counted as one): read before and after each batch is measured."""
    reference: Callable[[], float] | None = reference_ms
    """How fast the host is now (:func:`reference_ms`): read before and after each batch is measured on a CPU;
    None: not read."""
    speed_bound: float = 0.2
    """A reference that moved by more than this share (of the faster reading) while a batch was measured means
    the host's speed changed under it: the batch is untrusted."""
    retries: int = 2
    """A batch measured while the host's speed moved (beyond ``speed_bound``) is measured again right away, at
    most this many times while the machine is not busy, and the steadiest attempt kept
    (``docs/notes/0003-layer-time-cache-trust.md``)."""
    reuse_bound: float = 0.1
    """A cached batch whose reference differs by more than this share from the host's now is measured again:
    the cached times are another speed's (``docs/notes/0003-layer-time-cache-trust.md``)."""
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    """A load above this many cores means the machine was busy: such measurements are not trusted."""
    memory_budget: int | None = None
    """Bytes a profiling pass may take; None: :func:`memory_budget` of the device."""
    gpu: Gpu | None = None
    """The device seam a GPU profile measures device time through (every layer captured and replayed,
    :mod:`~deeppool.planner.profiling.devicetime`); None: the real GPU of a CUDA ``device``, none on a CPU.
    The fake (:class:`~deeppool.device.fake.FakeGpu`) here runs that path on a CPU in the tests."""
    device_replays: int = 10
    """Replays each captured layer is timed over, with a GPU."""

    def untrusted(self, measured: Measured) -> bool:
        """Whether ``measured`` was taken on a busy machine or while the host's speed moved (:meth:`busy`), or
        stayed noisy (a layer above the noise floor)."""
        noisy = measured.spread > self.spread_bound and measured.fwd_ms + measured.bwd_ms >= NOISE_FLOOR_MS
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
        """The batch-normalising layers' times as they run on ``g > 1`` ranks (:mod:`~deeppool.planner.profiling.group_times`)."""
        self.code = {layer.name: layer_code(traced.module, layer) for layer in graph.layers}
        self._early_sharing: dict[int, float] | None = None
        """The cores' sharing as measuring began (:meth:`_sharing`)."""
        self.gpu = config.gpu if config.gpu is not None else gpu_for(self.device)
        """The seam a GPU's device time is measured through; None on a CPU (the host is the device)."""
        self.device_costs: dict[int, dict[str, LayerCost]] = {}
        """By measured batch, with a GPU: every layer's device time and ops (:func:`measure_layers`)."""
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
                    self._measure_device(batch)
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
        ratios = self._grouped_layers.ratios(_inputs(self, batch), batch, lambda work: timed(self.device, work),
                                             self._same_code)
        for name, ratio in ratios.items():
            fused = self.measured[name][batch]
            self.grouped.setdefault(name, {})[batch] = replace(fused, fwd_ms=fused.fwd_ms * ratio.fwd,
                                                               bwd_ms=fused.bwd_ms * ratio.bwd)

    def _measure_device(self, batch: int) -> None:
        """With a GPU, every layer's device time (captured and replayed) and ops at ``batch``."""
        if self.gpu is None:
            return
        with self.gpu.on(self.device):
            self.device_costs[batch] = measure_layers(self.passes, _inputs(self, batch), batch, self.gpu,
                                                      replays=self.config.device_replays)

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
        overhead, bandwidth, shares = self._device_figures
        measured = Profile(
            device=device_name(device),
            source="measured",
            dtype=graph.layers[0].dtype if graph.layers else "float32",
            memory_bytes=device_memory(device),
            memory_bandwidth=bandwidth,
            layers={name: times for name, (times, _) in layers.items()},
            grouped=grouped,
            fit=fit_quality(batches, [errors for _, errors in layers.values()], ordered, config.spread_bound),
            concurrent_ranks=sharing.concurrent_ranks(device, config.threads),
            measured_sharing=shares,
            step_overhead=overhead,
            loss=loss,
            conditions=self.conditions(),
            whole_pass={batch: self.whole[batch] for batch in batches if batch in self.whole},
        )
        if self.gpu is None or not self.device_costs:
            return measured
        with self.gpu.on(device):
            host = host_cost(config.cache_dir, self.gpu, device, device_name(device))
        return with_device_time(measured, self.device_costs, host)

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
        passes = len(Optimizer.first_order()) * (STEP_WARMUP + STEP_REPEATS)
        fitting = [batch for batch in self.batches if batch in self.whole
                   and passes * (self.whole[batch].fwd_ms + self.whole[batch].bwd_ms) <= STEP_BUDGET_MS]
        return max(fitting, default=self.batches[0])

    def _measure_sharing(self) -> dict[int, float]:
        """How ranks share the cores (:func:`measure_sharing`), on a CPU profile planned for ranks; else none."""
        config = self.config
        return sharing.measure_sharing(sharing.sharing_counts(config.ranks), config.threads or 1) \
            if self.device.type == "cpu" and config.ranks else {}

    def _sharing(self) -> dict[int, float]:
        """The cores' sharing measured twice, as measuring began and after it, the lower of the two at each
        count: a slow stretch of the host only adds to it (``docs/notes/0005-core-sharing.md``)."""
        later = self._measure_sharing()
        early = self._early_sharing or {}
        return {g: min(share, early.get(g, share)) for g, share in later.items()}


LOSS = "<loss>"
"""The loss function's key among the measured entries (no layer name has angle brackets)."""
WHOLE = "<whole pass>"
"""The whole pass's key among one batch's measured entries (:meth:`Passes.whole`)."""


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
        measured = {name: summary([f[name] for f, _ in runs], [b[name] for _, b in runs], load)
                    for name in graph.names}
        settled = all(m.spread <= config.spread_bound or m.fwd_ms + m.bwd_ms < NOISE_FLOOR_MS
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

    The warm-up stays although the layer-by-layer passes just ran the same kernels
    (``docs/notes/0002-whole-pass-scaling.md``)."""
    runs = [passes.whole(inputs, batch=batch) for _ in range(config.warmup + config.repeats)][config.warmup:]
    return summary([f for f, _ in runs], [b for _, b in runs], max(load, config.load()))


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
    text = f"loss|{getattr(loaded.loss, '__qualname__', loaded.loss)}|{source_digest(loaded.loss)}|{shapes}|{batch}|" \
           f"{device_name(device)}|{torch.__version__}|{config.threads}"
    key = hashlib.sha256(text.encode()).hexdigest()
    found = cache.get(key) if cache else None
    if found is not None and not config.remeasure((found,), reference):
        return found
    load = config.load()
    fwd, bwd = [], []
    for repeat in range(config.warmup + max(config.repeats, 5)):
        value = pytree.tree_map(_fresh_leaf, output)
        forward_ms, loss = timed(device, lambda v=value: loaded.loss(v, targets))
        backward_ms = timed(device, loss.backward)[0] if isinstance(loss, torch.Tensor) and loss.requires_grad else 0.0
        if repeat >= config.warmup:
            fwd.append(forward_ms)
            bwd.append(backward_ms)
    totals = [f + b for f, b in zip(fwd, bwd, strict=True)]
    measured = Measured(fwd_ms=statistics.median(fwd), bwd_ms=statistics.median(bwd), spread=relative_spread(totals),
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


