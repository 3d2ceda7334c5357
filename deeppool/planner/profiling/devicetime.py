"""A layer's time as the device runs it, the host's cost to issue it, and a stage's time from both.

**Device time.** A layer's forward, and its forward with its backward, are each captured once as a graph
(CUDA graphs through the seam, :meth:`~deeppool.device.seam.Gpu.capture`) at the batch asked for, after
warm-up runs on the capture stream; ``replays`` back-to-back replays are timed between two device events.
A replay is one launch, so the host runs ahead and the events measure the device's work alone, not the
host's time to issue it (:func:`replay_ms`). The backward's time is the pair's minus the forward's. A
layer whose work cannot be captured (a host read, a data-dependent shape) is timed between events as it
runs, and says so (:attr:`DeviceTimes.captured`).

**Host cost.** The executor's own cost to issue a layer is its operator count (the aten ops its generated
code dispatches, forward and backward, counted on any device: :func:`count_ops`) times the host's cost
per operator (:class:`HostCost`), measured once per host, torch version and device
(:func:`measure_host_cost`: a chain of small ops issued without a wait, and its backward).

**A stage's time.** The executor issues a stage's layers in order and never waits for the device inside
a stage, so the host issues layer ``i`` once it has issued layers ``1..i-1`` and the device runs it once
both it is issued and layer ``i-1`` has run. That is a two-machine flow shop, whose makespan is

    T = max over k of ( h_1 + … + h_k  +  d_k + … + d_n )

with ``h_i`` the host's issue time of layer ``i`` and ``d_i`` its device time (:func:`stage_ms`; the
backward runs its layers in reverse order, with the same formula). ``max(Σh, Σd) ≤ T ≤ Σh + Σd``: a
stage is device-bound (``T ≈ Σd``) when the device's work outlasts the host's issue from the first
layer on, host-bound (``T ≈ Σh``) when the host's issue outlasts it. A host wait inside a stage (a
``.item()``) ends it: what follows is a new stage.
"""

from __future__ import annotations

import getpass
import json
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deeppool.device.seam import Gpu
from deeppool.errors import DeeppoolError
from deeppool.model.layer_exec import floating_leaves, run_at
from deeppool.planner.profiling.passes import Passes
from deeppool.planner.profiling.profile import LayerTimes, Profile

HOST_COST_SCHEMA = 1
HOST_OPS = 200
"""Ops in the chain :func:`measure_host_cost` issues (a GPU's launch queue holds about a thousand)."""


def stage_ms(host_ms: Sequence[float], device_ms: Sequence[float]) -> float:
    """A stage's time from its layers' host issue times and device times, in the order they are issued:
    ``max_k (Σ_{i≤k} h_i + Σ_{i≥k} d_i)`` (the module's docstring); 0 for no layers."""
    if len(host_ms) != len(device_ms):
        raise DeeppoolError("a stage needs one host and one device time per layer")
    if min([*host_ms, *device_ms], default=0.0) < 0:
        raise DeeppoolError("host and device times must be >= 0")
    issued, best = 0.0, 0.0
    remaining = sum(device_ms)
    for host, device in zip(host_ms, device_ms, strict=True):
        issued += host
        best = max(best, issued + remaining)
        remaining -= device
    return best


@dataclass(frozen=True, kw_only=True)
class DeviceTimes:
    """One layer's device time at one batch, forward and backward (ms)."""

    fwd_ms: float
    bwd_ms: float
    captured: bool
    """Timed as graph replays (True) or, where capture failed, between events as it ran (False)."""


def replay_ms(gpu: Gpu, device: torch.device, work: Callable[[], object], *, replays: int = 10,
              warmup: int = 2) -> float:
    """The device's ms per run of ``work``, captured once as a graph and replayed ``replays`` times back to
    back between two events, after ``warmup`` runs on the capture stream (libraries allocate their
    workspaces there, as capture requires). The caller is inside ``gpu.on(device)``."""
    if replays < 1 or warmup < 0:
        raise DeeppoolError("replays must be >= 1 and warm-up runs >= 0")
    current = gpu.current_stream(device)
    stream = gpu.stream(device)
    stream.wait_stream(current)
    with gpu.use(stream):
        for _ in range(warmup):
            work()
    gpu.synchronize(device)
    graph = gpu.graph()
    with gpu.capture(graph, stream):
        work()
    current.wait_stream(stream)
    graph.replay()  # the first replay uploads the graph: untimed
    start, end = gpu.event(), gpu.event()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


def event_ms(gpu: Gpu, device: torch.device, work: Callable[[], object], *, repeats: int = 10) -> float:
    """The median ms of ``work`` between two events after a synchronisation: the fallback for work that
    cannot be captured (its host issue time is in it where the device waits for the host)."""
    times = []
    for _ in range(repeats + 1):
        gpu.synchronize(device)
        start, end = gpu.event(), gpu.event()
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def layer_device_times(gpu: Gpu, device: torch.device, forward: Callable[[], object],
                       backward_of: Callable[[object], object] | None, *, replays: int = 10) -> DeviceTimes:
    """A layer's device times: ``forward()`` runs its forward on static inputs, ``backward_of(output)`` its
    backward from static output gradients (None: the layer has no backward). Both are captured and replayed
    (:func:`replay_ms`); where capture fails, both are timed as they run (:func:`event_ms`)."""

    def both() -> object:
        return backward_of(forward()) if backward_of is not None else None

    try:
        fwd = replay_ms(gpu, device, forward, replays=replays)
        pair = replay_ms(gpu, device, both, replays=replays) if backward_of is not None else fwd
        return DeviceTimes(fwd_ms=fwd, bwd_ms=max(0.0, pair - fwd), captured=True)
    except DeeppoolError:
        raise
    except Exception:  # noqa: BLE001  any op that cannot be captured: timed as it runs instead
        gpu.synchronize(device)
        fwd = event_ms(gpu, device, forward)
        pair = event_ms(gpu, device, both) if backward_of is not None else fwd
        return DeviceTimes(fwd_ms=fwd, bwd_ms=max(0.0, pair - fwd), captured=False)


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def count_ops(work: Callable[[], object]) -> tuple[int, object]:
    """How many aten ops ``work`` dispatches (each is one pass through the dispatcher on the host), and
    what it returned. The backward's ops are counted when ``work`` runs it (autograd runs them on the
    calling thread for CPU tensors, and the mode follows it to the engine's threads)."""
    counter = _Counter()
    with counter:
        result = work()
    return counter.ops, result


@dataclass(frozen=True, kw_only=True)
class HostCost:
    """The host's cost to issue one aten op (ms): in a forward (the dispatcher and the launch) and in a
    backward (an autograd node's too), measured on ``device`` of ``host`` with ``torch``."""

    fwd_op_ms: float
    bwd_op_ms: float
    host: str
    torch: str
    device: str

    def __post_init__(self) -> None:
        if not (self.fwd_op_ms >= 0 and self.bwd_op_ms >= 0):
            raise DeeppoolError("a host cost per op must be >= 0")

    def issue_ms(self, fwd_ops: int, bwd_ops: int) -> tuple[float, float]:
        """The host's (forward, backward) issue ms of a layer of these op counts."""
        return fwd_ops * self.fwd_op_ms, bwd_ops * self.bwd_op_ms

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": HOST_COST_SCHEMA, **asdict(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HostCost:
        try:
            return cls(fwd_op_ms=float(data["fwd_op_ms"]), bwd_op_ms=float(data["bwd_op_ms"]),
                       host=str(data["host"]), torch=str(data["torch"]), device=str(data["device"]))
        except (KeyError, TypeError, ValueError):
            raise DeeppoolError("a host cost file needs fwd_op_ms, bwd_op_ms, host, torch and device") from None


def host_key(device_name: str) -> str:
    """What a host cost holds for: this host, user, torch version and device."""
    return f"{platform.node()}-{getpass.getuser()}-{torch.__version__}-{device_name}".replace("/", "_")


def measure_host_cost(gpu: Gpu | None, device: torch.device, device_name: str, *, ops: int = HOST_OPS,
                      repeats: int = 5) -> HostCost:
    """The host's issue cost per op on ``device``: the median over ``repeats`` of a chain of ``ops`` small
    adds issued after a synchronisation (the device idle, so nothing waits) over ``ops``, and the same for
    its backward. On a CPU the ops run as they are issued: the figure is then the dispatcher's and the
    kernel's together (tiny tensors: mostly the dispatcher's)."""
    base = torch.ones(8, device=device)

    def forward() -> torch.Tensor:
        value = base
        for _ in range(ops):
            value = value + 1.0
        return value

    def host_ms(work: Callable[[], object]) -> float:
        if gpu is not None:
            gpu.synchronize(device)
        began = time.perf_counter()
        work()
        return 1e3 * (time.perf_counter() - began) / ops

    fwd, bwd = [], []
    for _ in range(repeats + 1):
        fwd.append(host_ms(forward))
        leaf = base.detach().requires_grad_(True)
        out = leaf
        for _ in range(ops):
            out = out * 1.0
        total = out.sum()
        bwd.append(host_ms(lambda total=total: total.backward()))
    if gpu is not None:
        gpu.synchronize(device)
    return HostCost(fwd_op_ms=statistics.median(fwd[1:]), bwd_op_ms=statistics.median(bwd[1:]),
                    host=platform.node(), torch=torch.__version__, device=device_name)


def host_cost(cache_dir: Path | None, gpu: Gpu | None, device: torch.device, device_name: str) -> HostCost:
    """The host cost for this host, torch and device: read from ``cache_dir`` where measured before, else
    measured (:func:`measure_host_cost`) and kept there."""
    path = cache_dir / f"host-cost-{host_key(device_name)}.json" if cache_dir is not None else None
    if path is not None and path.exists():
        return HostCost.from_json(json.loads(path.read_text()))
    cost = measure_host_cost(gpu, device, device_name)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cost.to_json(), indent=2) + "\n")
    return cost


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """One layer at one batch: its device times (None: not measured) and the aten ops its forward and
    backward dispatch."""

    device: DeviceTimes | None
    fwd_ops: int
    bwd_ops: int


def measure_layers(passes: Passes, inputs: dict[str, torch.Tensor], batch: int, gpu: Gpu | None, *,
                   replays: int = 10) -> dict[str, LayerCost]:
    """Every layer's :class:`LayerCost` at ``batch``, in order: its inputs are the values the layers before
    it computed (leaves that take gradients where the executor's do); its backward starts from ones at
    its output and yields its inputs' and parameters' gradients. With ``gpu`` (the caller is inside
    ``gpu.on``) its device times are measured too; without, only its ops are counted."""
    flows, module, device = passes.flows, passes.module, passes.device
    values: dict[str, object] = dict(inputs)
    found: dict[str, LayerCost] = {}
    with passes.drawing():
        for index, layer in enumerate(passes.graph.layers):
            args = [_leaf(values[name], flows.get(name, False)) for name in layer.inputs]
            runner = passes.runners[layer.name]
            wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            wrt += [p for p in (module.get_parameter(name) for name in layer.params) if p.requires_grad]

            def forward(runner: Any = runner, args: list = args) -> object:
                return run_at(runner, args, batch)

            fwd_ops, output = count_ops(forward)
            outputs = floating_leaves(output)
            grads = [torch.ones_like(t) for t in outputs]
            backward_of = None if not outputs or not wrt else \
                (lambda out, grads=grads, wrt=wrt: torch.autograd.grad(floating_leaves(out), wrt, grads,
                                                                      allow_unused=True))
            bwd_ops = count_ops(lambda b=backward_of, o=output: b(o))[0] if backward_of is not None else 0
            timed = None if gpu is None else layer_device_times(gpu, device, forward, backward_of, replays=replays)
            found[layer.name] = LayerCost(device=timed, fwd_ops=fwd_ops, bwd_ops=bwd_ops)
            values[layer.name] = output.detach() if isinstance(output, torch.Tensor) else output
            for name in layer.inputs:
                if passes.last_use[name] == index:
                    values.pop(name, None)
    return found


def _leaf(value: object, grad: bool) -> object:
    """An input as the executor's stage holds it: detached, taking gradients where they flow."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(grad and value.is_floating_point())
    return value


def with_device_time(profile: Profile, costs: dict[int, dict[str, LayerCost]], host: HostCost) -> Profile:
    """``profile`` (measured with events) with the device's and the host's times apart: at each batch of
    ``costs``, a layer's :attr:`Profile.layers` times are its device times (graph replay) and its
    :attr:`Profile.host` times its ops times ``host``'s cost per op; at the profile's other batches, the
    device time is the measured time scaled by the nearest batch of ``costs``' ratio, the host time the
    nearest batch's (a layer's ops do not grow with the batch). The cost model overlaps the two by the stage
    formula (:func:`stage_ms`). Every layer needs its device times at every batch of ``costs``."""
    if not costs:
        raise DeeppoolError("no device times to build a profile from")
    device: dict[int, dict[str, tuple[float, float]]] = {}
    issue: dict[int, dict[str, tuple[float, float]]] = {}
    for batch, found in costs.items():
        missing = sorted(set(profile.layers) - {n for n, c in found.items() if c.device is not None})
        if missing:
            raise DeeppoolError(f"no device time for layer '{missing[0]}' at batch {batch}")
        device[batch] = {name: _device(found[name]) for name in profile.layers}
        issue[batch] = {name: host.issue_ms(found[name].fwd_ops, found[name].bwd_ops) for name in profile.layers}
    layers = {name: _replaced(times, {b: at[name] for b, at in device.items()})
              for name, times in profile.layers.items()}
    issued = {name: _nearest(times, {b: at[name] for b, at in issue.items()}) for name, times in profile.layers.items()}
    return replace(profile, layers=layers, host=issued, source=f"{profile.source}+device-time")


def _device(cost: LayerCost) -> tuple[float, float]:
    assert cost.device is not None
    return cost.device.fwd_ms, cost.device.bwd_ms


def _nearest(times: LayerTimes, new: dict[int, tuple[float, float]]) -> LayerTimes:
    """``times``' batches, each with the value of the nearest batch of ``new``."""
    chosen = [new[min(new, key=lambda b: (abs(b - batch), b))] for batch in times.batches]
    return LayerTimes(batches=times.batches, fwd_ms=tuple(c[0] for c in chosen), bwd_ms=tuple(c[1] for c in chosen))


def _replaced(times: LayerTimes, new: dict[int, tuple[float, float]]) -> LayerTimes:
    fwd, bwd = list(times.fwd_ms), list(times.bwd_ms)
    for index, batch in enumerate(times.batches):
        nearest = min(new, key=lambda b: (abs(b - batch), b))
        old = times.at(nearest)
        scale_fwd = new[nearest][0] / old[0] if old[0] > 0 else 1.0
        scale_bwd = new[nearest][1] / old[1] if old[1] > 0 else 1.0
        fwd[index], bwd[index] = (new[batch] if batch in new else (fwd[index] * scale_fwd, bwd[index] * scale_bwd))
    return replace(times, fwd_ms=tuple(fwd), bwd_ms=tuple(bwd))
