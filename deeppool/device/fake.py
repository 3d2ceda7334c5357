"""A faithful fake :class:`~deeppool.device.seam.Gpu` on CPU: CUDA's ordering rules, checked.

Every tensor op a thread runs inside :meth:`FakeGpu.on` is an *item* of work on the thread's current
stream. Items run on the CPU, but their order is the device's: each item carries a vector clock of the
items it may rely on (its stream's earlier items, and the items behind every event or stream it was
told to wait on). The fake keeps, per storage, the item that last wrote it and the items that read it
since, and raises :class:`StreamOrderError` when an item

* reads what another stream wrote, without having waited for that write (a missing wait), or
* writes what another stream wrote or is reading, without having waited for it;

and when the host reads a value during a graph capture (CUDA forbids it). A graph
(:meth:`FakeGpu.capture`) records the ops run while capturing; :meth:`FakeGraph.replay` issues them as
one *deferred* item on the current stream, run when something waits for it: then, among the ready items
of every stream, the one of highest priority (lowest number) runs first. Events are timed with the
host clock (``time.perf_counter``): an event's time is the latest of its recording and the end of the
work it follows, so ``elapsed_time`` measures what ran between two events. A collective
(:meth:`FakeGpu.collective`) waits for the stream current at its launch and writes its tensors on a
communication stream; its handle's ``wait`` makes the waiting thread's current stream wait for it
(NCCL's semantics), after waiting for the real (gloo) work.

*Modelled durations* (``op_ms``, off by default): each op's device time is given by a function of its
name instead of the CPU time it takes. Items then run on a device timeline: an item starts at the
latest of its issue, its stream's previous item's end and the ends of what it waited for, and lasts its
modelled time (a replay: the sum of its captured ops'); streams overlap without sharing throughput. A
host wait (``synchronize``, ``Event.synchronize``, ``.item()``) returns once the host clock has reached
the end of the work it waited for, sleeping until then, as a host waits for a GPU. Timings read through
events are then the modelled ones, whatever the CPU's load.

Tests read :attr:`FakeGpu.log`: the items that ran, with their stream, label and times.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from deeppool.device.mps import MpsDaemon, Run
from deeppool.device.seam import Work

HOST_READS = frozenset({torch.ops.aten._local_scalar_dense.default})
"""Ops that copy a device value to the host (``.item()``, ``float(t)``): not allowed while capturing."""

PRIORITIES = (0, -5)
"""(least, greatest), as ``torch.cuda.Stream.priority_range()`` answers on recent GPUs."""


class StreamOrderError(RuntimeError):
    """Work that a GPU could run in the wrong order: a read or write before the event it needed."""


Clock = dict[int, int]
"""Stream id -> how many of that stream's items must have completed."""


@dataclass(eq=False)
class _Item:
    stream: FakeStream
    index: int
    label: str
    deps: Clock
    issued_s: float
    run: Callable[[], None] | None = None
    start_s: float | None = None
    end_s: float | None = None
    ms: float | None = None
    """Its modelled device time (``FakeGpu(op_ms=...)``); None: the CPU time it takes."""


class FakeStream:
    def __init__(self, gpu: FakeGpu, sid: int, priority: int, name: str) -> None:
        self.gpu, self.id, self.priority, self.name = gpu, sid, priority, name
        self.items: list[_Item] = []
        self.clock: Clock = {}
        self.completed = 0

    def position(self) -> Clock:
        """What an event recorded now would stand for."""
        return {**self.clock, self.id: len(self.items)}

    def wait_event(self, event: FakeEvent) -> None:
        with self.gpu.lock:
            self.gpu.wait(self, event.position())

    def wait_stream(self, other: FakeStream) -> None:
        with self.gpu.lock:
            self.gpu.wait(self, other.position())

    def synchronize(self) -> None:
        self.gpu.host_waits({self.id: len(self.items)})

    def __repr__(self) -> str:
        return f"stream {self.name} (priority {self.priority})"


class FakeEvent:
    def __init__(self, gpu: FakeGpu) -> None:
        self.gpu = gpu
        self._clock: Clock | None = None
        self._issued_s = 0.0

    def record(self, stream: FakeStream | None = None) -> None:
        with self.gpu.lock:
            stream = stream or self.gpu.current_stream()
            self._clock, self._issued_s = stream.position(), self.gpu.clock()

    def position(self) -> Clock:
        if self._clock is None:
            raise StreamOrderError("waiting on an event that was never recorded")
        return self._clock

    def synchronize(self) -> None:
        self.gpu.host_waits(self.position())

    def query(self) -> bool:
        self.gpu.advance()
        clock = self.position()
        return self.gpu.reached(clock) and max(self.gpu.ends(clock), default=0.0) <= self.gpu.clock()

    def time_s(self) -> float:
        clock = self.position()
        if not self.gpu.reached(clock):
            raise StreamOrderError("elapsed_time of an event whose work has not completed: synchronize first")
        return max([self._issued_s, *self.gpu.ends(clock)])

    def elapsed_time(self, end: FakeEvent) -> float:
        return 1e3 * (end.time_s() - self.time_s())


@dataclass(eq=False)
class FakeGraph:
    """The ops captured, the tensors they read and write, and the values the capture overwrote: a
    capture runs nothing on a GPU, so what it wrote into tensors that existed before is put back."""

    ops: list[tuple[Any, tuple, dict, Any]] = field(default_factory=list)
    reads: list[torch.Tensor] = field(default_factory=list)
    writes: list[torch.Tensor] = field(default_factory=list)
    gpu: FakeGpu | None = None
    saved: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    fresh: set[int] = field(default_factory=set)

    def before_write(self, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            if _key(tensor) not in self.fresh:
                self.saved.append((tensor, tensor.detach().clone()))

    def undo(self) -> None:
        for tensor, value in reversed(self.saved):
            tensor.detach().copy_(value)
        self.saved.clear()

    def replay(self) -> None:
        if self.gpu is None:
            raise StreamOrderError("replay of a graph that was never captured")
        self.gpu.issue("replay", self.reads, self.writes, run=self._run, ms=self.modelled_ms())

    def modelled_ms(self) -> float | None:
        """The sum of the captured ops' modelled times (None when the fake does not model them)."""
        if self.gpu is None or self.gpu.op_ms is None:
            return None
        return sum(self.gpu.op_ms(func.__name__) for func, *_ in self.ops)

    def _run(self) -> None:
        with torch.no_grad():
            for func, args, kwargs, outs in self.ops:
                result = func(*args, **kwargs)
                for old, new in zip(tree_leaves(outs), tree_leaves(result), strict=False):
                    if isinstance(old, torch.Tensor) and _key(old) != _key(new):
                        old.copy_(new)


class _FakeWork:
    def __init__(self, gpu: FakeGpu, work: Work, item: _Item) -> None:
        self.gpu, self.work, self.item = gpu, work, item

    def wait(self) -> Any:
        result = self.work.wait()
        with self.gpu.lock:
            self.item.end_s = max(self.item.end_s or 0.0, self.gpu.clock())
            self.gpu.wait(self.gpu.current_stream(), {self.item.stream.id: self.item.index + 1})
        return result


class _Tracker(TorchDispatchMode):
    def __init__(self, gpu: FakeGpu) -> None:
        super().__init__()
        self.gpu = gpu

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return self.gpu.op(func, args, kwargs or {})


class FakeGpu:
    """The fake. ``gpus`` is what :meth:`count` answers; :meth:`bind` records the index it chose.

    ``op_ms``: each op's modelled device time in ms, by its name (``"mm.default"``, ``"replay"`` is not
    asked: a replay lasts its captured ops' sum; ``"collective"`` is); None: the CPU time each takes.
    ``sleep`` is how a host wait lets the clock reach the device's time.
    """

    backend = "gloo"

    def __init__(self, *, gpus: int = 1, memory_bytes: int = 80 * 2**30, clock: Callable[[], float] = time.perf_counter,
                 mps_run: Run | None = None, op_ms: Callable[[str], float] | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.gpus, self.memory_bytes, self.clock, self._mps_run = gpus, memory_bytes, clock, mps_run
        self.op_ms, self.sleep = op_ms, sleep
        self.lock = threading.RLock()
        self.streams: list[FakeStream] = []
        self.default = self._new_stream(0, "default")
        self.comm = self._new_stream(0, "collectives")
        self.log: list[_Item] = []
        self.bound: list[int] = []
        self._local = threading.local()
        self._writer: dict[int, _Item] = {}
        self._readers: dict[int, dict[int, _Item]] = {}

    # -- discovery, binding, memory ------------------------------------------------------------
    def available(self) -> bool:
        return self.gpus > 0

    def count(self) -> int:
        return self.gpus

    def bind(self, local_rank: int) -> torch.device:
        self.bound.append(local_rank % self.gpus)
        return torch.device("cpu")

    def current(self) -> torch.device:
        return torch.device("cpu")

    def name(self, device: torch.device) -> str:
        return "fake-gpu"

    def total_memory(self, device: torch.device) -> int:
        return self.memory_bytes

    def free_memory(self, device: torch.device) -> int:
        return self.memory_bytes

    def generator(self, device: torch.device) -> torch.Generator:
        return torch.default_generator

    @contextlib.contextmanager
    def on(self, device: torch.device) -> Iterator[None]:
        del device
        with _Tracker(self):
            yield

    # -- streams -------------------------------------------------------------------------------
    def priority_range(self) -> tuple[int, int]:
        return PRIORITIES

    def stream(self, device: torch.device | None = None, priority: int = 0) -> FakeStream:
        least, greatest = PRIORITIES
        if not greatest <= priority <= least:
            raise StreamOrderError(f"stream priority {priority} is outside {PRIORITIES}")
        return self._new_stream(priority, f"s{len(self.streams)}")

    def current_stream(self, device: torch.device | None = None) -> FakeStream:
        return getattr(self._local, "stream", self.default)

    @contextlib.contextmanager
    def use(self, stream: FakeStream) -> Iterator[None]:
        saved = self.current_stream()
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = saved

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        del tensor, stream  # CPU memory is not reused behind a stream's back

    # -- events, graphs, synchronisation ---------------------------------------------------------
    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def graph(self) -> FakeGraph:
        return FakeGraph()

    def graph_pool(self) -> object:
        return object()  # CPU memory is not reused behind a graph's back: a pool is only a token here

    @contextlib.contextmanager
    def capture(self, graph: FakeGraph, stream: FakeStream, pool: object = None) -> Iterator[None]:
        del pool
        if getattr(self._local, "capturing", None) is not None:
            raise StreamOrderError("a graph capture inside another")
        graph.gpu = self
        self._local.capturing = graph
        try:
            with self.use(stream):
                yield
        finally:
            self._local.capturing = None
            with torch.no_grad():
                self._raw(graph.undo)

    def synchronize(self, device: torch.device | None = None) -> None:
        self.host_waits({s.id: len(s.items) for s in self.streams})

    # -- collectives and MPS -------------------------------------------------------------------
    def collective(self, launch: Callable[[], Work], tensors: Sequence[torch.Tensor]) -> Work:
        with self.lock:
            self.wait(self.comm, self.current_stream().position())
            item = self._issue_on(self.comm, "collective", list(tensors), list(tensors), None)
        return _FakeWork(self, self._raw(launch), item)  # the item above is the collective's place in order

    def mps_daemon(self) -> contextlib.AbstractContextManager[Any]:
        if self._mps_run is None:
            raise StreamOrderError("this fake has no MPS control (give mps_run=)")
        return MpsDaemon.running(self._mps_run, on_path=False)  # the stand-in control is not on PATH

    # -- the model: items, clocks, hazards -----------------------------------------------------
    def op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        graph = getattr(self._local, "capturing", None)
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if getattr(self._local, "raw", False) or not all(_real(t) for t in inputs):
            return func(*args, **kwargs)  # replaying, or tracing with fake or meta tensors
        if graph is not None:
            return self._captured(graph, func, args, kwargs)
        written = _written(func, args, kwargs)
        holder: list[Any] = []

        def run() -> None:
            holder.append(func(*args, **kwargs))

        item = self.issue(func.__name__, inputs, written, run=run)
        if func in HOST_READS:  # a copy to the host waits for the stream
            self.host_waits({item.stream.id: item.index + 1})
        self._complete_item(item)
        result = holder[0]
        with self.lock:
            self._allocated(item, [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)], inputs)
        return result

    def issue(self, label: str, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor],
              run: Callable[[], None] | None, ms: float | None = None) -> _Item:
        with self.lock:
            return self._issue_on(self.current_stream(), label, reads, writes, run, ms)

    def wait(self, stream: FakeStream, clock: Clock) -> None:
        for sid, count in clock.items():
            if sid != stream.id:
                stream.clock[sid] = max(stream.clock.get(sid, 0), count)

    def host_waits(self, clock: Clock) -> None:
        """The calling thread waits for ``clock``: what it issues from now on comes after that work."""
        self.complete(clock)
        late = max(self.ends(clock), default=0.0) - self.clock()
        if late > 0:  # modelled work ends on the device's timeline: the host waits for it
            self.sleep(late)
        known = self.host_clock()
        for sid, count in clock.items():
            known[sid] = max(known.get(sid, 0), count)

    def host_clock(self) -> Clock:
        if not hasattr(self._local, "host"):
            self._local.host = {}
        return self._local.host

    def reached(self, clock: Clock) -> bool:
        return all(self.streams[sid].completed >= count for sid, count in clock.items())

    def ends(self, clock: Clock) -> list[float]:
        return [self.streams[sid].items[count - 1].end_s or 0.0 for sid, count in clock.items() if count > 0]

    def complete(self, clock: Clock) -> None:
        """Run deferred work, highest priority first among ready items, until ``clock`` is reached."""
        with self.lock:
            while not self.reached(clock):
                if not self.advance():
                    raise StreamOrderError("waiting for work that can never run")

    def advance(self) -> bool:
        """Run one ready item (the highest priority, then the earliest issued); False when none is ready."""
        with self.lock:
            ready = [s.items[s.completed] for s in self.streams
                     if s.completed < len(s.items) and self.reached(s.items[s.completed].deps)]
            if not ready:
                return False
            item = min(ready, key=lambda i: (i.stream.priority, i.issued_s))
            self._execute(item)
            return True

    def _complete_item(self, item: _Item) -> None:
        self.complete({item.stream.id: item.index + 1})

    def _execute(self, item: _Item) -> None:
        if item.ms is None:
            item.start_s = max([self.clock(), *self.ends(item.deps)])
        else:  # the device's timeline: from its issue or what it waits for, for its modelled time
            item.start_s = max([item.issued_s, *self.ends(item.deps)])
        if item.run is not None:
            self._raw(item.run)
        item.end_s = max(self.clock(), item.start_s) if item.ms is None else item.start_s + item.ms / 1e3
        item.stream.completed += 1
        self.log.append(item)

    def _issue_on(self, stream: FakeStream, label: str, reads: Sequence[torch.Tensor],
                  writes: Sequence[torch.Tensor], run: Callable[[], None] | None, ms: float | None = None) -> _Item:
        deps = stream.position()
        for sid, count in self.host_clock().items():
            deps[sid] = max(deps.get(sid, 0), count)
        if ms is None and self.op_ms is not None:
            ms = self.op_ms(label)
        item = _Item(stream=stream, index=len(stream.items), label=label, deps=deps, issued_s=self.clock(), run=run,
                     ms=ms)
        written = {_key(t) for t in writes} - {0}
        for key in {_key(t) for t in reads} - {0}:
            self._check(item, key, self._writer.get(key), "reads")
        for key in written:
            self._check(item, key, self._writer.get(key), "writes over")
            for reader in self._readers.get(key, {}).values():
                self._check(item, key, reader, "writes over what is read by")
        for key in {_key(t) for t in reads} - {0} - written:
            self._readers.setdefault(key, {})[stream.id] = item
        for key in written:
            self._writer[key] = item
            self._readers[key] = {}
        stream.items.append(item)
        if run is None:
            self.complete({stream.id: item.index + 1})
        return item

    def _check(self, item: _Item, key: int, other: _Item | None, verb: str) -> None:
        if other is None or other.stream is item.stream or item.deps.get(other.stream.id, 0) > other.index:
            return
        raise StreamOrderError(
            f"{item.label} on {item.stream} {verb} {other.label} on {other.stream} without waiting for it "
            f"(storage {key:#x}): record an event after that work and make {item.stream.name} wait on it"
        )

    def _allocated(self, item: _Item, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
        """Fresh outputs are new memory written by ``item`` (views of inputs are not)."""
        existing = {_key(t) for t in inputs}
        for tensor in outputs:
            key = _key(tensor)
            if key and key not in existing:
                self._writer[key] = item
                self._readers[key] = {}

    def _captured(self, graph: FakeGraph, func: Any, args: tuple, kwargs: dict) -> Any:
        if func in HOST_READS:
            raise StreamOrderError(f"{func.__name__} reads a device value on the host during graph capture")
        written = _written(func, args, kwargs)
        self._raw(lambda: graph.before_write(written))
        result = self._raw(lambda: func(*args, **kwargs))
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
        existing = {_key(t) for t in inputs}
        graph.fresh.update(_key(t) for t in outputs if _key(t) not in existing)
        graph.ops.append((func, args, kwargs, result))
        graph.reads.extend(inputs)
        graph.writes.extend([*written, *outputs])
        return result

    def _raw(self, call: Callable[[], Any]) -> Any:
        saved, self._local.raw = getattr(self._local, "raw", False), True
        try:
            return call()
        finally:
            self._local.raw = saved

    def _new_stream(self, priority: int, name: str) -> FakeStream:
        with self.lock:
            stream = FakeStream(self, len(self.streams), priority, name)
            self.streams.append(stream)
            return stream


def _real(tensor: torch.Tensor) -> bool:
    """A CPU tensor with memory (not a tracer's fake or meta tensor)."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.device.type == "cpu"


def _key(tensor: Any) -> int:
    if not isinstance(tensor, torch.Tensor) or tensor.layout is not torch.strided or not _real(tensor):
        return 0
    return tensor.untyped_storage().data_ptr()


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The arguments ``func`` writes to, from its schema's alias annotations (``Tensor(a!)``)."""
    written: list[torch.Tensor] = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        written.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return written


def fake_mps_control(calls: list[tuple[str, dict[str, str]]], root: Path) -> Run:
    """A stand-in for ``subprocess.run`` of ``nvidia-cuda-mps-control``: records each call and its MPS
    environment, and keeps a ``control`` pipe file in the pipe directory while the daemon is up."""
    import subprocess

    def run(command: list[str], *, env: dict[str, str], input: str | None = None, **_: Any) -> Any:
        keep = {k: v for k, v in env.items() if k.startswith("CUDA_MPS_")}
        calls.append((" ".join([*command, (input or "").strip()]).strip(), keep))
        pipe = Path(env["CUDA_MPS_PIPE_DIRECTORY"]) / "control"
        if command[-1] == "-d":
            if pipe.exists():
                return subprocess.CompletedProcess(command, 1, "", "An instance of this daemon is already running")
            pipe.touch()
        elif (input or "").strip() == "quit":
            pipe.unlink(missing_ok=True)
        (root / "mps-calls.txt").open("a").write(calls[-1][0] + "\n")
        return subprocess.CompletedProcess(command, 0, "", "")

    return run
