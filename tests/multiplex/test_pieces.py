"""``--mux priority``'s step cut at layer boundaries into CUDA-graph pieces (:mod:`deeppool.multiplex.pieces`), on
CPU through the fake GPU: the cut itself, piece lengths against the target on modelled device times, the
stream order between pieces, training exactly as the uncut step, pieces only inside windows; and the
same exactness on a real GPU (marked ``gpu``)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

from deeppool.device.cuda import CudaGpu
from deeppool.device.fake import FakeGpu, StreamOrderError
from deeppool.device.seam import Gpu
from deeppool.executor.config import OptimizerConfig
from deeppool.multiplex.config import PRIORITY_PIECE_MS, BackgroundConfig, MuxMode
from deeppool.multiplex.drill import priority_drill, violations
from deeppool.multiplex.job import BackgroundJob, _slice, forward, load_background
from deeppool.multiplex.pieces import (BACKWARD, FORWARD, ROUNDS, STALE, STEP, WARMUP_STEPS, StepPieces, capture,
                                       cut, rows_for, segments_of, trace_background)
from deeppool.plans import Optimizer
from tests.multiplex.plans import BACKGROUND, MODELS

CPU = torch.device("cpu")
RESIDUAL = MODELS / "residual_bg.py"
BATCH, SEED, STEPS = 8, 3, 4
SGD = OptimizerConfig(kind=Optimizer.SGD, lr=0.05, momentum=0.9)
VIEWS = frozenset({"t", "view", "_unsafe_view", "detach", "alias", "expand", "transpose", "permute", "unsqueeze",
                   "squeeze", "reshape", "as_strided"})


def op_ms(name: str) -> float:
    """The fake's modelled device time of an op: 0.05 ms, views nothing."""
    return 0.0 if name.split(".")[0] in VIEWS else 0.05


class VirtualClock:
    """Host time that passes only when the host waits for the device: modelled timings come out exact."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_cut_closes_each_piece_before_it_passes_the_target() -> None:
    assert cut([0.2, 0.2, 0.2, 0.7, 0.1, 0.1], 0.5) == [range(0, 2), range(2, 3), range(3, 4), range(4, 6)]
    assert cut([], 0.5) == [] and cut([0.0, 0.0], 0.5) == [range(0, 2)]
    rng = random.Random(0)
    for _ in range(200):
        ms = [rng.expovariate(1 / 0.2) for _ in range(rng.randint(1, 40))]
        groups = cut(ms, 0.5)
        assert [i for g in groups for i in g] == list(range(len(ms)))
        sums = [sum(ms[i] for i in g) for g in groups]
        assert all(s <= 0.5 or len(g) == 1 for s, g in zip(sums, groups, strict=True))  # one layer may be longer
        assert all(a + b > 0.5 for a, b in zip(sums, sums[1:], strict=False))  # no two neighbours would fit one


def test_autograd_is_cut_wherever_a_forward_or_a_backward_piece_starts() -> None:
    assert segments_of([range(0, 3), range(3, 6)], [range(4, 6), range(1, 4), range(0, 1)], 6) == \
        [range(0, 1), range(1, 3), range(3, 4), range(4, 6)]


class CutRun(NamedTuple):
    timing: list[float]
    """The timing steps' losses."""
    replayed: list[float]
    params: list[torch.Tensor]
    pieces: StepPieces
    stream: Any
    """The stream the pieces were captured and replayed on."""


def _cut_run(gpu: Gpu, device: torch.device, model: Path, piece_ms: float, *, traced: bool = True) -> CutRun:
    """Capture ``model``'s step in pieces and replay :data:`STEPS` steps."""
    with gpu.on(device):
        loaded = load_background(model)
        found = trace_background(loaded) if traced else None
        job = BackgroundJob(loaded, batch=BATCH, optimizer=SGD, seed=SEED, device=device)
        if found is not None:
            found.module.to(device)
        least, _ = gpu.priority_range()
        stream = gpu.stream(device, priority=least)
        pieces = capture(gpu, job, stream, piece_ms, found)
        losses = []
        with gpu.use(stream):
            for _ in range(STEPS):
                for graph in pieces.graphs:
                    graph.replay()
                losses.append(pieces.step_loss())
        gpu.current_stream(device).wait_stream(stream)
        params = [p.detach().clone() for p in job.module.parameters()]
    return CutRun(timing=job.losses[WARMUP_STEPS:], replayed=losses, params=params, pieces=pieces, stream=stream)


def _uncut_run(device: torch.device, model: Path, rows: int) -> tuple[list[float], list[torch.Tensor]]:
    """The same job trained eagerly, uncut, on the same (captured) batch for the same steps: the timing steps of
    the whole batch, those of ``rows`` rows when fewer, then :data:`STEPS` in micro-steps of ``rows`` rows (each
    loss weighted by its share, gradients accumulated, as ``BackgroundJob.micro_step`` does)."""
    job = BackgroundJob(load_background(model), batch=BATCH, optimizer=SGD, seed=SEED, device=device)
    for _ in range(WARMUP_STEPS):
        job.train_step()
    inputs, targets = job._batch()
    losses = []
    for size in [BATCH] * ROUNDS + ([rows] * ROUNDS if rows < BATCH else []) + [rows] * STEPS:
        total = 0.0
        for first in range(0, BATCH, size):
            last = min(first + size, BATCH)
            output = forward(job.module, _slice(inputs, first, last))
            loss = job.loaded.loss(output, _slice(targets, first, last)) * ((last - first) / BATCH)
            loss.backward()
            total += float(loss.detach())
        job.optimizer.step()
        job.optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, [p.detach().clone() for p in job.module.parameters()]


@pytest.mark.parametrize(("model", "piece_ms", "traced"), [
    (BACKGROUND, PRIORITY_PIECE_MS, True),
    (RESIDUAL, 1e-6, True),  # every layer a piece, in micro-steps of one row; a value and a tied weight get
    (RESIDUAL, 1e3, True),  # gradients from two pieces. 1e3: one forward piece, one backward piece
    (BACKGROUND, 1e-6, False),  # a model that is not traced: one layer
])
def test_the_cut_step_trains_exactly_as_the_uncut_step(model: Path, piece_ms: float, traced: bool) -> None:
    timing, replayed, params, pieces, _ = _cut_run(FakeGpu(), CPU, model, piece_ms, traced=traced)
    reference, expected = _uncut_run(CPU, model, pieces.rows)
    assert timing + replayed == reference  # exactly: the same kernels on the same values
    assert all(torch.equal(a, b) for a, b in zip(params, expected, strict=True))
    assert pieces.kinds[-1] == STEP and pieces.kinds.count(STEP) == 1
    assert list(pieces.micro) == sorted(pieces.micro) and pieces.micro[-1] == -(-BATCH // pieces.rows) - 1
    if piece_ms >= 1e3:
        assert pieces.kinds == (FORWARD, BACKWARD, STEP) and pieces.rows == BATCH
    elif piece_ms < 1e-3:
        assert pieces.rows == 1  # a layer of the whole batch is longer than a piece: micro-steps of one row
        first = [names for kind, names, micro in zip(pieces.kinds, pieces.layers, pieces.micro, strict=True)
                 if kind == FORWARD and micro == 0]
        units = {BACKGROUND: 6, RESIDUAL: 9}[model] if traced else 2  # the layers and the loss
        assert all(len(names) == 1 for names in first) and len(first) == units  # one layer each


def test_rows_per_micro_step_keep_the_longest_layer_phase_within_a_piece() -> None:
    assert rows_for(0.4, 32, 0.5) == 32 and rows_for(2.0, 32, 0.5) == 8 and rows_for(100.0, 32, 0.5) == 1


def test_piece_lengths_are_near_the_target_on_the_modelled_device() -> None:
    clock = VirtualClock()
    gpu = FakeGpu(op_ms=op_ms, clock=clock, sleep=clock.sleep)
    target = 0.3
    pieces = _cut_run(gpu, CPU, BACKGROUND, target).pieces
    assert pieces.rows == BATCH  # no layer phase is longer than the target: no micro-steps
    for kind in (FORWARD, BACKWARD):
        planned = [(ms, names) for k, ms, names in zip(pieces.kinds, pieces.planned_ms, pieces.layers, strict=True)
                   if k == kind]
        assert len(planned) >= 2, pieces
        assert all(ms <= target + 1e-9 or len(names) == 1 for ms, names in planned)
        assert all(a + b > target for (a, _), (b, _) in zip(planned, planned[1:], strict=False))
    replays = [item for item in gpu.log if item.label == "replay"][-len(pieces.graphs):]  # the last replayed step
    modelled = [1e3 * ((item.end_s or 0.0) - (item.start_s or 0.0)) for item in replays]
    assert modelled == pytest.approx(list(pieces.planned_ms), rel=1e-6)  # each piece lasts what its layers did


def test_each_piece_reads_what_the_piece_before_it_wrote() -> None:
    """Pieces replay on one stream, in order; on two streams the fake refuses a piece without its wait."""
    gpu = FakeGpu()
    run = _cut_run(gpu, CPU, BACKGROUND, 1e-6)
    pieces = run.pieces
    with gpu.on(CPU):
        first, second = gpu.stream(CPU), gpu.stream(CPU)
        for stream in (first, second):
            stream.wait_stream(gpu.current_stream(CPU))
            stream.wait_stream(run.stream)
        with gpu.use(first):
            pieces.graphs[0].replay()
        with gpu.use(second), pytest.raises(StreamOrderError, match="reads replay on stream"):
            pieces.graphs[1].replay()
        done = gpu.event()
        done.record(first)
        second.wait_event(done)
        with gpu.use(second):
            pieces.graphs[1].replay()
        gpu.synchronize(CPU)


def test_a_piece_known_only_from_the_timing_steps_is_tried_after_a_few_refusals() -> None:
    pieces = StepPieces(graphs=[object(), object()], ms=[1.0, 3.0], planned_ms=(1.0, 3.0),  # type: ignore[list-item]
                        kinds=(FORWARD, STEP), layers=(("a",), ()), micro=(0, 0), rows=1, losses=[], keep=[])
    assert pieces.fits(0, 2e-3) and not pieces.fits(1, -1e-3)  # a window already over counts no refusal
    assert [pieces.fits(1, 2e-3) for _ in range(STALE + 1)] == [False] * STALE + [True]
    pieces.measured(1, 3.0)  # replayed in a window: its own replays decide from now on
    assert not any(pieces.fits(1, 2e-3) for _ in range(2 * STALE))


@pytest.mark.slow
def test_layer_pieces_start_only_inside_windows_on_the_modelled_device() -> None:
    gpu = FakeGpu(op_ms=op_ms)
    drill = priority_drill(gpu, CPU, BACKGROUND, windows=8, late=2, piece_ms=0.2)
    assert drill.result.error is None, drill.result.error
    assert drill.pieces is not None and drill.pieces.kinds.count(FORWARD) >= 2
    assert drill.pieces.kinds.count(BACKWARD) >= 2
    background = next(s for s in gpu.streams if s.priority == gpu.priority_range()[0] and s.name.startswith("s"))
    pieces = [(i.start_s or 0.0, i.end_s or 0.0) for i in gpu.log if i.stream is background and i.label == "replay"]
    in_windows = [p for p in pieces if p[0] > drill.windows[0][0]]
    assert len(in_windows) >= 2 * len(drill.pieces.graphs), "the background ran too little to test anything"
    assert violations(in_windows, drill) == []
    assert drill.result.steps >= 2 and drill.result.losses[-1] < drill.result.losses[0]
    assert drill.result.dropped_tokens >= drill.late


def test_the_piece_length_is_an_option_and_the_priority_modes_default() -> None:
    from deeppool import options
    from deeppool.errors import DeeppoolError
    from deeppool.multiplex.options import BENCH_BACKGROUND, RUN_BACKGROUND

    assert MuxMode.PRIORITY.piece_ms == PRIORITY_PIECE_MS == 0.5
    assert all(mode.piece_ms is None for mode in MuxMode if mode is not MuxMode.PRIORITY)
    assert BackgroundConfig(model=BACKGROUND).piece_ms == PRIORITY_PIECE_MS
    for group in (RUN_BACKGROUND, BENCH_BACKGROUND):
        assert "--piece-ms" in [option.flag for option in options.options(group)]
    with pytest.raises(DeeppoolError, match="--piece-ms 0"):
        BackgroundConfig(model=BACKGROUND, piece_ms=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("model", "piece_ms"), [(BACKGROUND, 1e-6), (RESIDUAL, 1e-6), (RESIDUAL, PRIORITY_PIECE_MS)])
def test_the_cut_step_trains_exactly_as_the_uncut_step_on_a_real_gpu(model: Path, piece_ms: float) -> None:
    device = torch.device("cuda", 0)
    timing, replayed, params, pieces, _ = _cut_run(CudaGpu(), device, model, piece_ms)
    reference, expected = _uncut_run(device, model, pieces.rows)
    assert timing + replayed == reference, f"pieces {pieces.kinds}: {timing + replayed} != {reference}"
    assert all(torch.equal(a, b) for a, b in zip(params, expected, strict=True))
