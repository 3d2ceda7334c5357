"""Profile: forward and backward time of every layer at per-GPU batch sizes.

A Profile is either *measured* (by :mod:`deeppool.planner.profiling.profiler` on a local
CPU or CUDA device) or *estimated* from a :class:`DeviceModel`. Times at a
batch size between measured ones are interpolated linearly; above the largest
they are extrapolated from the last two points. The Profile also carries the
device's memory size, which the planner's memory constraint uses, its
effective memory bandwidth, from which the optimizer step's memory traffic
follows, and, when measured, what a step costs beyond that traffic
(:class:`StepOverhead`) and the loss function's times (:attr:`Profile.loss`).
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from deeppool.errors import DeeppoolError
from deeppool.model.graph import Layer, LayerGraph
from deeppool.plans import Precision
from deeppool.plans.jsonio import field as json_field
from deeppool.plans.jsonio import read_json, write_json
from deeppool.planner.hardware import DeviceModel

PROFILE_SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class LayerTimes:
    """Measured (fwd_ms, bwd_ms) of one layer, by per-GPU batch size."""

    batches: tuple[int, ...]
    fwd_ms: tuple[float, ...]
    bwd_ms: tuple[float, ...]
    spread: tuple[float, ...] = ()
    """By batch: the relative spread (scaled MAD over the median) of the repeated measurements the time
    rests on (at a fitted batch, the nearest measured one's); empty: not measured (an estimate)."""
    busy: tuple[bool, ...] = ()
    """By batch: whether the time rests on a measurement taken on a busy machine (load above the cores)
    or one that stayed noisy; empty: none."""

    def __post_init__(self) -> None:
        if not self.batches or list(self.batches) != sorted(set(self.batches)):
            raise DeeppoolError("profile batch sizes must be distinct and increasing")
        if not len(self.batches) == len(self.fwd_ms) == len(self.bwd_ms):
            raise DeeppoolError("profile batch sizes and times differ in length")
        if any(len(extra) not in (0, len(self.batches)) for extra in (self.spread, self.busy)):
            raise DeeppoolError("profile batch sizes and spreads differ in length")

    def at(self, batch: int) -> tuple[float, float]:
        return _interpolate(self.batches, self.fwd_ms, batch), _interpolate(
            self.batches, self.bwd_ms, batch
        )

    def _nearest(self, batch: int) -> int:
        return min(range(len(self.batches)), key=lambda i: (abs(self.batches[i] - batch), self.batches[i]))

    def spread_at(self, batch: int) -> float:
        """The relative spread of the measurements the time at ``batch`` rests on (0: unknown)."""
        return self.spread[self._nearest(batch)] if self.spread else 0.0

    def busy_at(self, batch: int) -> bool:
        """Whether the time at ``batch`` rests on a measurement taken on a busy machine or a noisy one."""
        return self.busy[self._nearest(batch)] if self.busy else False


def _interpolate(xs: tuple[int, ...], ys: tuple[float, ...], x: int) -> float:
    if len(xs) == 1:
        return ys[0] * x / xs[0]
    index = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[index - 1], xs[index], ys[index - 1], ys[index]
    if x <= x0:
        return max(y0 * x / x0, 0.0)
    return max(y0 + (y1 - y0) * (x - x0) / (x1 - x0), 0.0)


@dataclass(frozen=True, kw_only=True)
class StepOverhead:
    """One optimizer's step beyond its memory traffic: a fixed cost per call (``step()`` and
    ``zero_grad()``, once per iteration on every rank) and one per parameter tensor (its update
    loop's dispatch), measured by the profiler on tiny tensors, and one per megabyte of parameters that a
    step right after a real backward pays beyond streaming them (the backward left them out of the caches;
    freeing the gradients it allocated), measured on the model's own parameters; 0 where not measured."""

    call_ms: float = 0.0
    per_tensor_ms: float = 0.0
    per_megabyte_ms: float = 0.0

    def __post_init__(self) -> None:
        if not (self.call_ms >= 0 and self.per_tensor_ms >= 0 and self.per_megabyte_ms >= 0):
            raise DeeppoolError("a step overhead must be >= 0: regenerate the profile")


@dataclass(frozen=True, kw_only=True)
class Conditions:
    """What a measured profile was measured under: the highest load (runnable tasks) seen while measuring
    (cached measurements included), the host's cores, the intra-op threads, torch's version, the device."""

    load: float
    cores: int
    threads: int | None
    torch: str
    device: str

    @property
    def busy(self) -> bool:
        """Whether some measurement was taken with more runnable work than cores."""
        return self.load > self.cores


@dataclass(frozen=True, kw_only=True)
class FitQuality:
    """How well a measured profile's line fits held its points, and how noisy the measuring was."""

    measured_batches: tuple[int, ...]
    error_p50: float
    error_p90: float
    noisy: int
    measurements: int
    spread_bound: float
    compared: int

    def describe(self, bound: float = 0.25) -> str:
        """One line for people; it warns when the fit or the measurements are loose."""
        line = (f"profile measured at per-GPU batches {list(self.measured_batches)} (the times there are the "
                "measured ones; other batches fitted, t = a + b·batch): ")
        if self.compared:
            line += f"fit error median {100 * self.error_p50:.1f}%, p90 {100 * self.error_p90:.1f}% ({self.compared} points)"
        else:
            line += "fit error not measured (every layer is below the timer's noise floor)"
        if self.noisy:
            line += f"; warning: {self.noisy} of {self.measurements} measurements stayed noisy (spread > {100 * self.spread_bound:.0f}%)"
        if self.error_p90 > bound:
            line += "; warning: the fit is loose, the machine may be busy: re-plan on a quieter machine"
        return line


@dataclass(frozen=True, kw_only=True)
class WholePass:
    """One per-GPU batch's whole training pass, as a one-stage executor runs it (the layers' forwards
    chained, one backward from the output), against the sums of its layers' in-context times: each layer
    runs on its own leaves and its backward is its own ``torch.autograd.backward`` call, which the whole
    pass does not pay (``benchmarks/backward_split.py`` measures the difference). The profile's layer times at the batch are
    scaled by :attr:`fwd_ratio` and :attr:`bwd_ratio`, so that they add up to the whole pass."""

    fwd_ms: float
    bwd_ms: float
    layer_fwd_ms: float
    """The sum of the layers' median forward ms, as measured layer by layer."""
    layer_bwd_ms: float

    @property
    def fwd_ratio(self) -> float:
        return self.fwd_ms / self.layer_fwd_ms if self.layer_fwd_ms > 0 and self.fwd_ms > 0 else 1.0

    @property
    def bwd_ratio(self) -> float:
        return self.bwd_ms / self.layer_bwd_ms if self.layer_bwd_ms > 0 and self.bwd_ms > 0 else 1.0


@dataclass(frozen=True, kw_only=True)
class Profile:
    """Per-layer times on one device, keyed by layer name."""

    device: str
    source: str
    dtype: str
    memory_bytes: int
    memory_bandwidth: float = 100e9
    layers: dict[str, LayerTimes] = field(default_factory=dict)
    grouped: dict[str, LayerTimes] = field(default_factory=dict)
    """The layers that normalise the batch, timed as they run on ``g > 1`` ranks: their BatchNorm synchronised
    over the group (:mod:`deeppool.planner.profiling.group_times`), its collectives apart; empty: not measured (an
    estimate prices those layers' arithmetic as on one rank)."""
    fit: FitQuality | None = None
    concurrent_ranks: int | None = None
    """Ranks that compute at once at the measured speed: on a CPU, the host's cores over the
    intra-op threads a rank was measured with; None where each rank has its own device (a GPU)."""
    measured_sharing: dict[int, float] = field(default_factory=dict)
    """On a CPU, ``sharing(g)`` measured by the profiler at some rank counts ``g``: how much slower
    each of ``g`` workers computing at once ran than one alone (cores shared with other work, SMT
    siblings or a CPU quota make it differ from ``g / concurrent_ranks``); empty: not measured."""
    step_overhead: dict[str, StepOverhead] = field(default_factory=dict)
    """By optimizer (``sgd``, ``adam``): its measured :class:`StepOverhead`; empty: not measured."""
    loss: LayerTimes | None = None
    """The loss function's (forward, backward) ms by per-GPU batch, on the output layer's ranks; None:
    not measured (an estimated profile)."""
    conditions: Conditions | None = None
    """What the measurements were taken under; None: not measured here (an estimate, an older file)."""
    whole_pass: dict[int, WholePass] = field(default_factory=dict)
    """By measured per-GPU batch: the whole pass the layer times there were scaled to (empty: not scaled, an
    estimate or an older file)."""
    host: dict[str, LayerTimes] = field(default_factory=dict)
    """On a GPU, the host's time to issue each layer's forward and backward (its ops times the host's cost per
    op, :mod:`deeppool.planner.profiling.devicetime`), :attr:`layers` then holding the device's time to run
    them: the cost model overlaps the two by the stage formula. Empty: the layer times are the whole cost
    (a CPU, where the host is the device; an estimate; an older file)."""
    schema_version: int = PROFILE_SCHEMA_VERSION

    def times(self, layer: str, batch: int, *, grouped: bool = False) -> tuple[float, float]:
        """(fwd_ms, bwd_ms) of ``layer`` at a per-GPU batch of ``batch`` samples; with ``grouped``, as the layer
        runs on several ranks (its BatchNorm synchronised, where measured)."""
        if batch <= 0:
            return 0.0, 0.0
        return (self.grouped if grouped and layer in self.grouped else self.layers)[layer].at(batch)

    def host_times(self, layer: str, batch: int) -> tuple[float, float]:
        """(fwd_ms, bwd_ms) the host takes to issue ``layer`` at ``batch`` ((0, 0) where not measured)."""
        if batch <= 0 or layer not in self.host:
            return 0.0, 0.0
        return self.host[layer].at(batch)

    def spread(self, layer: str, batch: int) -> float:
        """The relative spread of the measurements ``layer``'s time at ``batch`` rests on (0: unknown)."""
        return self.layers[layer].spread_at(batch) if batch > 0 else 0.0

    def busy(self, layer: str, batch: int) -> bool:
        """Whether ``layer``'s time at ``batch`` rests on a measurement taken on a busy machine, or a noisy one."""
        return self.layers[layer].busy_at(batch) if batch > 0 else False

    @property
    def measured_batches(self) -> tuple[int, ...]:
        """The per-GPU batches measured (the others fitted); empty for an estimate."""
        return self.fit.measured_batches if self.fit is not None else ()

    def loss_times(self, batch: int) -> tuple[float, float]:
        """(fwd_ms, bwd_ms) of the loss at a per-GPU batch of ``batch`` samples (0 where not measured)."""
        if self.loss is None or batch <= 0:
            return 0.0, 0.0
        return self.loss.at(batch)

    def overhead(self, optimizer: str) -> StepOverhead:
        """The measured :class:`StepOverhead` of ``optimizer`` (zero where not measured)."""
        return self.step_overhead.get(optimizer, StepOverhead())

    def sharing(self, ranks: int) -> float:
        """How much slower each of ``ranks`` ranks computing at once runs than one measured alone.

        Measured (:attr:`measured_sharing`, with ``sharing(1) = 1``): interpolated linearly between the
        measured counts, and beyond the largest ``m``, ``sharing(m) · g / m`` (time-slicing is linear);
        else ``max(1, g / concurrent_ranks)`` (ranks beyond the cores share them); 1 on GPUs."""
        if self.measured_sharing:
            points = sorted({1: 1.0, **self.measured_sharing}.items())
            counts = tuple(count for count, _ in points)
            if ranks >= counts[-1]:
                return points[-1][1] * ranks / counts[-1]
            return _interpolate(counts, tuple(value for _, value in points), ranks)
        if self.concurrent_ranks is None:
            return 1.0
        return max(1.0, ranks / self.concurrent_ranks)

    def check_covers(self, graph: LayerGraph) -> None:
        missing = [name for name in graph.names if name not in self.layers]
        if missing:
            raise DeeppoolError(
                f"profile ({self.device}) has no times for layer '{missing[0]}': "
                "it was measured for another model; profile this model again"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "artifact": "profile",
            "schema_version": self.schema_version,
            "device": self.device,
            "source": self.source,
            "dtype": self.dtype,
            "memory_bytes": self.memory_bytes,
            "memory_bandwidth": self.memory_bandwidth,
            "layers": {name: _times_json(t) for name, t in self.layers.items()},
            "grouped": {name: _times_json(t) for name, t in self.grouped.items()},
            "fit": None if self.fit is None else {**asdict(self.fit), "measured_batches": list(self.fit.measured_batches)},
            "concurrent_ranks": self.concurrent_ranks,
            "measured_sharing": {str(count): value for count, value in sorted(self.measured_sharing.items())},
            "step_overhead": {name: asdict(overhead) for name, overhead in sorted(self.step_overhead.items())},
            "loss": None if self.loss is None else _times_json(self.loss),
            **({"conditions": asdict(self.conditions)} if self.conditions is not None else {}),
            "whole_pass": {str(batch): asdict(whole) for batch, whole in sorted(self.whole_pass.items())},
            **({"host": {name: _times_json(t) for name, t in self.host.items()}} if self.host else {}),
        }

    @classmethod
    def from_json(cls, payload: dict[str, Any]) -> Profile:
        try:
            layers = {str(name): _times(entry) for name, entry in json_field(payload, "layers", kind="profile").items()}
            grouped = {str(name): _times(entry) for name, entry in (payload.get("grouped") or {}).items()}
            host = {str(name): _times(entry) for name, entry in (payload.get("host") or {}).items()}
            loss = None if payload.get("loss") is None else _times(payload["loss"])
            overhead = {str(name): StepOverhead(**entry) for name, entry in (payload.get("step_overhead") or {}).items()}
            conditions = Conditions(**payload["conditions"]) if payload.get("conditions") else None
            whole = {int(batch): WholePass(**{key: float(value) for key, value in entry.items()})
                     for batch, entry in (payload.get("whole_pass") or {}).items()}
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise DeeppoolError(f"profile JSON has a malformed layer entry ({err}): regenerate it") from None
        return cls(
            device=str(json_field(payload, "device", kind="profile")),
            source=str(json_field(payload, "source", kind="profile")),
            dtype=str(json_field(payload, "dtype", kind="profile")),
            memory_bytes=int(json_field(payload, "memory_bytes", kind="profile")),
            memory_bandwidth=float(json_field(payload, "memory_bandwidth", kind="profile")),
            layers=layers,
            grouped=grouped,
            fit=_fit(payload.get("fit")),
            concurrent_ranks=_concurrent(payload.get("concurrent_ranks")),
            measured_sharing=_sharing(payload.get("measured_sharing") or {}),
            step_overhead=overhead,
            loss=loss,
            conditions=conditions,
            whole_pass=whole,
            host=host,
        )

    def save(self, path: str | Path) -> None:
        write_json(path, self.to_json())

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_json(read_json(path, kind="profile", schema_version=PROFILE_SCHEMA_VERSION))


def _times_json(times: LayerTimes) -> dict[str, list[Any]]:
    found: dict[str, list[Any]] = {"batches": list(times.batches), "fwd_ms": list(times.fwd_ms),
                                   "bwd_ms": list(times.bwd_ms)}
    if times.spread:
        found["spread"] = list(times.spread)
    if times.busy:
        found["busy"] = list(times.busy)
    return found


def _times(entry: dict[str, Any]) -> LayerTimes:
    return LayerTimes(batches=tuple(int(b) for b in entry["batches"]), fwd_ms=tuple(float(t) for t in entry["fwd_ms"]),
                      bwd_ms=tuple(float(t) for t in entry["bwd_ms"]),
                      spread=tuple(float(s) for s in entry.get("spread", ())),
                      busy=tuple(bool(b) for b in entry.get("busy", ())))


def _concurrent(value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise DeeppoolError(f"profile JSON has concurrent_ranks {value!r}: it must be a positive integer or null")
    return value


def _sharing(entry: Any) -> dict[int, float]:
    try:
        sharing = {int(count): float(value) for count, value in dict(entry).items()}
    except (TypeError, ValueError) as err:
        raise DeeppoolError(f"profile JSON has a malformed measured_sharing ({err}): regenerate it") from None
    if any(count < 2 or value <= 0 for count, value in sharing.items()):
        raise DeeppoolError("profile JSON has measured_sharing at fewer than 2 ranks or a non-positive factor")
    return sharing


def _fit(entry: dict[str, Any] | None) -> FitQuality | None:
    if entry is None:
        return None
    try:
        return FitQuality(**{**entry, "measured_batches": tuple(entry["measured_batches"])})
    except (KeyError, TypeError) as err:
        raise DeeppoolError(f"profile JSON has a malformed fit entry ({err}): regenerate it") from None


def estimate_ms(layer: Layer, batch: int, device: DeviceModel, precision: Precision) -> tuple[float, float]:
    """Roofline estimate of (fwd_ms, bwd_ms) for ``layer`` at ``batch`` samples in ``precision``.

    fwd = max(max(F_fwd·b / (P_p·e_c), (2·A·b + W) / (BW·e_b)) + k_fwd·o,  n·h_fwd)
    bwd = max(max(F_bwd·b / (P_p·e_c), (4·A·b + 2·W) / (BW·e_b)) + k_bwd·o,  n·h_bwd)

    with F the per-sample FLOPs, A the per-sample activation bytes and W the
    parameter bytes (both in precision ``p``), P_p the device's peak FLOP/s in
    ``p`` for the layer's op (:meth:`DeviceModel.peak_for`: TF32 where PyTorch runs
    an fp32 op in TF32), BW the memory bandwidth, e the efficiencies, o the launch
    overhead, k = 1 (fwd) / 2 (bwd) kernels, n the layer's operators (fx nodes) and
    h the host's floor per operator (0 where the model has none). The larger of
    device and host per layer approximates the stage formula (``devicetime.stage_ms``)
    layer by layer, without the overlap of one layer's issue with another's device
    time: its sum lies between ``T - max_k min(h_k, d_k)`` and ``Σh + Σd ≤ 2T``.
    """
    flops_rate = device.peak_for(layer.op, precision) * device.compute_efficiency
    byte_rate = device.mem_bandwidth * device.bandwidth_efficiency
    scale = precision.scale(layer.dtype)
    activation, weights = layer.act_bytes * batch * scale, layer.param_bytes * scale
    fwd = max(layer.fwd_flops * batch / flops_rate, (2 * activation + weights) / byte_rate)
    bwd = max(layer.bwd_flops * batch / flops_rate, (4 * activation + 2 * weights) / byte_rate)
    overhead, operators = device.launch_overhead_s, len(layer.nodes)
    return 1e3 * max(fwd + overhead, operators * device.host_fwd_op_s), \
        1e3 * max(bwd + 2 * overhead, operators * device.host_bwd_op_s)


def estimated_profile(
    graph: LayerGraph, device: DeviceModel, batches: tuple[int, ...], precision: Precision | None = None,
) -> Profile:
    """A Profile computed from ``device``'s roofline at each of ``batches`` (precision: the model's by default)."""
    chosen = precision or Precision.of_dtype(graph.layers[0].dtype if graph.layers else "float32")
    ordered = tuple(sorted(set(batches)))
    layers = {}
    for layer in graph.layers:
        times = [estimate_ms(layer, batch, device, chosen) for batch in ordered]
        layers[layer.name] = LayerTimes(
            batches=ordered,
            fwd_ms=tuple(t[0] for t in times),
            bwd_ms=tuple(t[1] for t in times),
        )
    return Profile(
        device=device.name,
        source=f"device-model:{device.name}",
        dtype=chosen.value,
        memory_bytes=device.memory_bytes,
        memory_bandwidth=device.mem_bandwidth * device.bandwidth_efficiency,
        layers=layers,
    )
