"""The fake GPU's semantics: stream order, waits, events, graph replay, priorities, collectives, MPS."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from deeppool.device.fake import FakeGpu, StreamOrderError, fake_mps_control
from deeppool.device.mps import CONTROL, LOG, PERCENT, PIPE, client_env
from tests.net import free_port

CPU = torch.device("cpu")


def test_a_read_on_another_stream_needs_a_wait_for_the_write() -> None:
    gpu = FakeGpu()
    with gpu.on(CPU):
        side = gpu.stream(CPU)
        written = torch.ones(4) * 2  # on the default stream
        with gpu.use(side), pytest.raises(StreamOrderError, match="reads mul.Tensor on stream default"):
            written + 1
        side.wait_stream(gpu.current_stream(CPU))
        with gpu.use(side):
            summed = written + 1
        with pytest.raises(StreamOrderError, match="reads add.Tensor on stream s"):
            summed.sum()
        done = gpu.event()
        done.record(side)
        gpu.current_stream(CPU).wait_event(done)
        assert float(summed.sum()) == 12.0


def test_a_write_over_what_another_stream_reads_needs_a_wait() -> None:
    gpu = FakeGpu()
    with gpu.on(CPU):
        side = gpu.stream(CPU)
        buffer = torch.zeros(4)
        side.wait_stream(gpu.current_stream(CPU))
        with gpu.use(side):
            buffer * 3  # reads the buffer on the side stream
        with pytest.raises(StreamOrderError, match="writes over what is read by"):
            buffer.zero_()  # the default stream reuses it without waiting


def test_a_host_wait_orders_what_the_host_issues_next() -> None:
    gpu = FakeGpu()
    with gpu.on(CPU):
        side = gpu.stream(CPU)
        side.wait_stream(gpu.current_stream(CPU))
        with gpu.use(side):
            made = torch.arange(3.0) + 1
        side.synchronize()
        assert made.tolist() == [1.0, 2.0, 3.0]


def test_graph_replay_repeats_the_captured_work_and_capture_runs_nothing() -> None:
    gpu = FakeGpu()
    with gpu.on(CPU):
        counter, step = torch.zeros(2), torch.tensor([1.0, 2.0])
        stream = gpu.stream(CPU)
        stream.wait_stream(gpu.current_stream(CPU))
        graph = gpu.graph()
        with gpu.capture(graph, stream):
            counter.add_(step)
            doubled = counter * 2
        assert counter.tolist() == [0.0, 0.0]  # a capture issues nothing
        with gpu.use(stream):
            for _ in range(3):
                graph.replay()
        gpu.synchronize(CPU)
        assert counter.tolist() == [3.0, 6.0] and doubled.tolist() == [6.0, 12.0]
        assert [item.label for item in gpu.log[-3:]] == ["replay"] * 3


def test_a_host_read_during_capture_is_refused() -> None:
    gpu = FakeGpu()
    with gpu.on(CPU):
        stream = gpu.stream(CPU)
        with pytest.raises(StreamOrderError, match="during graph capture"), gpu.capture(gpu.graph(), stream):
            float(torch.ones(1).sum())


def test_priorities_order_the_ready_work() -> None:
    gpu = FakeGpu()
    order: list[str] = []
    with gpu.on(CPU):
        least, greatest = gpu.priority_range()
        low, high = gpu.stream(CPU, priority=least), gpu.stream(CPU, priority=greatest)
        graphs = {}
        for name, stream in (("low", low), ("high", high)):
            marker = torch.zeros(1)
            stream.wait_stream(gpu.current_stream(CPU))
            graphs[name] = (gpu.graph(), marker)
            with gpu.capture(graphs[name][0], stream):
                marker.add_(1)
        gate = gpu.event()
        gate.record()  # both streams wait on the same point, so their work becomes ready together
        for name, stream in (("low", low), ("high", high)):
            stream.wait_event(gate)
            with gpu.use(stream):
                graphs[name][0].replay()
                graphs[name][0].replay()
        gpu.synchronize(CPU)
        order = [item.stream.name for item in gpu.log if item.label == "replay"]
    assert order == [high.name, high.name, low.name, low.name]
    with pytest.raises(StreamOrderError, match="outside"):
        gpu.stream(CPU, priority=greatest - 1)


def test_events_time_the_work_between_them_and_refuse_before_it_completes() -> None:
    gpu = FakeGpu()
    with gpu.on(CPU):
        stream, big = gpu.stream(CPU), torch.randn(400, 400)
        stream.wait_stream(gpu.current_stream(CPU))
        graph = gpu.graph()
        with gpu.capture(graph, stream):
            big @ big @ big
        start, end = gpu.event(), gpu.event()
        with gpu.use(stream):
            start.record()
            graph.replay()
            end.record()
        with pytest.raises(StreamOrderError, match="not completed"):
            start.elapsed_time(end)
        end.synchronize()
        replay = next(item for item in gpu.log if item.label == "replay")
        assert start.elapsed_time(end) == pytest.approx(1e3 * (replay.end_s - replay.start_s), rel=0.5, abs=0.5)
        assert start.elapsed_time(end) > 0


def test_modelled_durations_time_the_device_and_the_host_waits_for_them() -> None:
    """With ``op_ms`` an op lasts its modelled time on the device's timeline, a replay its ops' sum, streams
    overlap, and a host wait lets the host clock reach the device's: timings exact whatever the CPU's load."""
    now = [10.0]
    gpu = FakeGpu(op_ms=lambda name: 2.0 if name.startswith("mul") else 0.0, clock=lambda: now[0],
                  sleep=lambda seconds: now.__setitem__(0, now[0] + seconds))
    with gpu.on(CPU):
        ones = torch.ones(4)
        low, high = gpu.stream(CPU, priority=0), gpu.stream(CPU, priority=-5)
        graphs = []
        for stream in (low, high):
            stream.wait_stream(gpu.current_stream(CPU))
            graphs.append(gpu.graph())
            with gpu.capture(graphs[-1], stream):
                ones * 3 * 2  # two modelled ops: 4 ms a replay
        start, end, other = gpu.event(), gpu.event(), gpu.event()
        with gpu.use(low):
            start.record()
            graphs[0].replay()
            graphs[0].replay()
            end.record()
        with gpu.use(high):
            graphs[1].replay()
            other.record()
        assert now[0] == 10.0 and not end.query()  # issued, not done: the device is behind the host
        end.synchronize()
        assert now[0] == pytest.approx(10.008)  # the host waited for the device's 8 ms
        assert start.elapsed_time(end) == pytest.approx(8.0) and start.elapsed_time(other) == pytest.approx(4.0)
        assert float((ones + 1).sum()) == 8.0 and now[0] == pytest.approx(10.008)  # no modelled op: no wait


def test_a_collective_follows_the_launching_stream_and_its_wait_orders_the_waiter() -> None:
    gpu = FakeGpu()
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=datetime.timedelta(seconds=30))
    group = dist.ProcessGroupGloo(store, 0, 1, datetime.timedelta(seconds=30))
    with gpu.on(CPU):
        side = gpu.stream(CPU)
        grads = torch.ones(8)
        side.wait_stream(gpu.current_stream(CPU))
        with gpu.use(side):
            flat = grads * 1
            work = gpu.collective(lambda: group.allreduce([flat]), [flat])
        with pytest.raises(StreamOrderError, match="reads collective"):
            flat.sum()  # read before waiting on the handle
        work.wait()
        assert float(flat.sum()) == 8.0


def test_bind_chooses_local_rank_modulo_the_device_count() -> None:
    gpu = FakeGpu(gpus=4)
    for local_rank in range(6):
        gpu.bind(local_rank)
    assert gpu.bound == [0, 1, 2, 3, 0, 1]


def test_the_mps_daemon_starts_with_private_directories_exports_them_and_quits(tmp_path: Path) -> None:
    calls: list[tuple[str, dict[str, str]]] = []
    gpu = FakeGpu(mps_run=fake_mps_control(calls, tmp_path))
    seen: dict[str, str] = {}
    saved_path = os.environ["PATH"]
    control = tmp_path / "bin" / CONTROL  # the daemon checks the control is on PATH before starting it
    control.parent.mkdir()
    control.write_text("#!/bin/sh\nexit 0\n")
    control.chmod(0o755)
    os.environ["PATH"] = f"{control.parent}:{saved_path}"
    try:
        with gpu.mps_daemon() as daemon:
            seen = {key: os.environ[key] for key in (PIPE, LOG)}
            assert (Path(seen[PIPE]) / "control").exists()  # the daemon is up while the ranks run
            assert daemon.env == seen
    finally:
        os.environ["PATH"] = saved_path
    assert [c for c, _ in calls] == [f"{CONTROL} -d", f"{CONTROL} quit"]
    assert all(env[PIPE] == seen[PIPE] and env[LOG] == seen[LOG] for _, env in calls)
    assert PIPE not in os.environ and not Path(seen[PIPE]).exists()  # restored and removed
    assert client_env(30) == {PERCENT: "30"}


def test_the_device_timing_paths_run_through_the_fake() -> None:
    """The profiler's and the executor's CUDA timing: device events, settled once per iteration."""
    import time

    from deeppool.executor.engine.timing import Category, Recorder
    from deeppool.planner.profiling.timing import timed

    gpu = FakeGpu()
    with gpu.on(CPU):
        big = torch.randn(300, 300)
        took, out = timed(CPU, lambda: big @ big, gpu)
        assert took > 0 and isinstance(out, torch.Tensor)
        recorder = Recorder(time.perf_counter, gpu.event)
        recorder.begin(0)
        with recorder.span(0, "matmul", Category.COMPUTE):
            big @ big @ big
        with recorder.span(0, "sleep", Category.COMPUTE):
            time.sleep(0.02)  # an idle device records the event when the host issues it
        recorder.settle()
    matmul, sleep = recorder.spans
    assert matmul.label == "matmul" and matmul.end_s > matmul.start_s and sleep.start_s >= matmul.end_s
    assert sleep.end_s - sleep.start_s >= 0.02


def test_a_rank_binds_the_gpu_its_local_rank_names_and_gloo_binds_none() -> None:
    """The worker's device choice (``--backend nccl``): GPU ``LOCAL_RANK % count``, through the seam."""
    from deeppool.errors import DeeppoolError
    from deeppool.executor.config import Backend
    from deeppool.executor.launch.worker import RankEnv, bind_device

    gpu = FakeGpu(gpus=4)
    for local_rank in (0, 3, 5):
        bind_device(Backend.NCCL, RankEnv(rank=local_rank, local_rank=local_rank, world_size=8), gpu)
    assert bind_device(Backend.GLOO, RankEnv(rank=0, local_rank=2, world_size=1), gpu) == CPU
    assert gpu.bound == [0, 3, 1]
    with pytest.raises(DeeppoolError, match="--backend nccl needs CUDA, and no GPU is visible"):
        bind_device(Backend.NCCL, RankEnv(rank=0, local_rank=0, world_size=1), FakeGpu(gpus=0))
