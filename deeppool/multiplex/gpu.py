"""``--mux priority``: the background as a thread in the rank's process, on a low-priority CUDA stream.

As DeepPool's runtime does (``BeTask.cpp``, ``GraphPieces.cpp``): the thread
shares the rank's CUDA context; the foreground runs on a high-priority stream
(:func:`foreground_stream`); after warm-up the background step is captured as
CUDA graphs, cut at layer boundaries into *pieces* of about ``piece_ms``
(``--piece-ms``, 0.5 ms as DeepPool; :mod:`deeppool.multiplex.pieces`), in
micro-steps of fewer rows where one layer of the whole batch is longer: forward
pieces, backward pieces, the optimizer step, replayed on a low-priority stream. A piece
is admitted only inside an idle window (a token from the listener, with a
deadline), at most one is in flight (the thread waits for its event before the
next), none is launched when its expected length (the median of its recent
replays) does not fit before the window's deadline, and none after the
executor has closed the window — so none runs into the foreground's next op,
all-reduce included. (The one exception: a piece known only from the timing
steps, which ran beside the foreground and may be inflated by it, is tried
once after it has been refused in a few windows in a row:
:meth:`~deeppool.multiplex.pieces.StepPieces.fits`.) On a rank that
runs no layer no op follows the window, so a piece launched before the deadline
may end after it (``overrun``). The controller shrinks the deadlines when the foreground slows.
Each finished background step's loss (read after the step's last piece has completed) is
reported, and so is each token that ran no piece (its window closed or too short: ``dropped``).

Every device call goes through the seam (:mod:`deeppool.device`): on a GPU the real
one; in the tests the fake (:class:`~deeppool.device.fake.FakeGpu`) runs this module
on CPU and checks its stream order. On a GPU the micro-step pieces it cut before
(rows, not layers) have run in the one-GPU ``priority`` drill of ``benchmarks/gpu.py``; the layer pieces have
not, and a multiplexed ``deeppool run`` needs two GPUs and has not (``docs/gpu.md``).
Constructing :class:`StreamBackground` without a GPU is a one-line error.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Iterator

import torch

from deeppool.device.cuda import CudaGpu
from deeppool.device.seam import Event, Gpu
from deeppool.errors import DeeppoolError
from deeppool.model.loading import LoadedModel
from deeppool.model.trace import Traced
from deeppool.multiplex.config import BackgroundConfig
from deeppool.multiplex.job import BackgroundJob, load_background
from deeppool.multiplex.metrics import RankBackground, window_samples
from deeppool.multiplex.pieces import StepPieces, capture, trace_background
from deeppool.plans import Optimizer


def require_gpu(gpu: Gpu) -> None:
    if not gpu.available():
        raise DeeppoolError("--mux priority needs a CUDA GPU and none is visible here: use --mux gate on CPU")


@contextlib.contextmanager
def foreground_stream(gpu: Gpu, device: torch.device) -> Iterator[None]:
    """Run the foreground on the highest-priority stream of ``device`` (after the work issued so far)."""
    _, highest = gpu.priority_range()
    stream = gpu.stream(device, priority=highest)
    stream.wait_stream(gpu.current_stream(device))
    with gpu.use(stream):
        yield


class StreamBackground:
    """The listener's background for ``--mux priority``: tokens in, graph pieces out, one in flight."""

    def __init__(self, config: BackgroundConfig, *, rank: int, device: torch.device, gpu: Gpu | None = None) -> None:
        self.gpu = gpu or CudaGpu()
        require_gpu(self.gpu)
        self.config, self.rank, self.device = config, rank, device
        self.pieces: StepPieces | None = None
        """The captured step, once the thread has captured it."""
        least, _ = self.gpu.priority_range()
        self.stream = self.gpu.stream(device, priority=least)
        self._tokens: queue.SimpleQueue[tuple[float, int, bool] | None] = queue.SimpleQueue()
        self._opened = 0
        self._closed = 0
        self._closed_ms: list[float | None] = []
        self._result: dict[str, object] = {"steps": 0, "busy_s": 0.0, "tokens": 0, "dropped": 0, "losses": [],
                                           "windows": [], "error": None, "start_step": 0, "pieces": 0}
        self._thread = threading.Thread(target=self._main, name=f"deeppool-bg-rank{rank}", daemon=True)

    def admit(self, deadline_s: float, window_ms: float, *, overrun: bool = False) -> None:
        del window_ms
        self._opened += 1
        self._tokens.put((deadline_s, self._opened, overrun))

    def close(self, window_ms: float | None) -> None:
        self._closed = self._opened  # read by the thread between pieces: no further launch in this window
        self._closed_ms.append(window_ms)

    def running(self, on: bool) -> None:
        del on

    def result_error(self) -> str | None:
        """The thread's error so far (None while it runs well)."""
        return self._result["error"]  # type: ignore[return-value]

    def pieces_run(self) -> int:
        """How many graph pieces have completed so far."""
        return int(self._result["pieces"])  # type: ignore[call-overload]

    def busy_s(self) -> float:
        """The device time its pieces took, over the windows the thread has finished serving."""
        return float(self._result["busy_s"])  # type: ignore[arg-type]

    def served(self) -> int:
        """How many windows (tokens) the thread has finished serving."""
        return len(self._result["windows"])  # type: ignore[arg-type]

    def wait_ready(self, timeout_s: float) -> None:
        """Start the thread at the first shared block, once the foreground has built and seeded its model.

        The background seeds its data with the process's global RNG, so it must not run while the
        foreground initialises. Tokens queue up until the graphs are captured; stale ones are skipped.
        """
        del timeout_s
        if not self._thread.is_alive() and self._thread.ident is None:
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> RankBackground:
        self._tokens.put(None)
        if self._thread.ident is not None:
            self._thread.join(timeout_s)
        r = self._result
        return RankBackground(
            rank=self.rank, pid=os.getpid(), exit_code=0 if r["error"] is None else 1, start_step=int(r["start_step"]),
            steps=int(r["steps"]), samples=int(r["steps"]) * self.config.batch, busy_s=float(r["busy_s"]),
            tokens=int(r["tokens"]), dropped_tokens=int(r["dropped"]), losses=tuple(r["losses"]), spans=(),
            windows=window_samples(self._closed_ms, r["windows"]), error=r["error"],
        )

    def _job(self, loaded: LoadedModel, traced: Traced | None) -> BackgroundJob:
        job = BackgroundJob(loaded, batch=self.config.batch, optimizer=self.config.optimizer,
                            seed=self.config.seed + self.rank, device=self.device,
                            checkpoint=self.config.checkpoint(self.rank))
        if traced is not None:
            traced.module.to(self.device)  # its own constants; the parameters are the job's, moved above
        if self.config.optimizer.kind is Optimizer.ADAM:  # graph capture needs capturable state
            job.optimizer = torch.optim.Adam(job.module.parameters(), lr=self.config.optimizer.lr, capturable=True)
        return job

    def _main(self) -> None:
        try:
            with self.gpu.on(self.device):
                loaded = load_background(self.config.model)
                traced = trace_background(loaded)  # on CPU, before the job moves the model to the device
                job = self._job(loaded, traced)
                self._result["start_step"] = job.step
                pieces = self.pieces = capture(self.gpu, job, self.stream, self.config.piece_ms, traced)
                self._serve(job, pieces)
                self.gpu.current_stream(self.device).wait_stream(self.stream)  # the checkpoint reads the weights
                job.save()
        except Exception as err:  # noqa: BLE001  reported; the foreground goes on
            self._result["error"] = f"{type(err).__name__}: {err}"

    def _serve(self, job: BackgroundJob, pieces: StepPieces) -> None:
        start, end = self.gpu.event(), self.gpu.event()
        with self.gpu.use(self.stream):
            self._loop(job, pieces, start, end)

    def _loop(self, job: BackgroundJob, pieces: StepPieces, start: Event, end: Event) -> None:
        index = 0
        while (token := self._tokens.get()) is not None:
            deadline, window, overrun = token
            self._result["tokens"] = int(self._result["tokens"]) + 1
            busy, ran = 0.0, 0
            while self._closed < window and (time.perf_counter() <= deadline if overrun else
                                             pieces.fits(index, deadline - time.perf_counter())):
                start.record(self.stream)
                pieces.graphs[index].replay()  # replays on the current stream: the low-priority one
                end.record(self.stream)
                end.synchronize()  # at most one piece in flight
                took = start.elapsed_time(end)
                pieces.measured(index, took)
                busy, ran = busy + took, ran + 1
                self._result["pieces"] = int(self._result["pieces"]) + 1  # type: ignore[call-overload]
                index = (index + 1) % len(pieces.graphs)
                if index == 0:
                    self._step_done(job, pieces)
            if ran == 0:
                self._result["dropped"] = int(self._result["dropped"]) + 1
            self._result["busy_s"] = float(self._result["busy_s"]) + busy / 1e3
            self._result["windows"].append(busy)  # type: ignore[union-attr]

    def _step_done(self, job: BackgroundJob, pieces: StepPieces) -> None:
        job.step += 1
        self._result["steps"] = int(self._result["steps"]) + 1
        self._result["losses"].append(pieces.step_loss())  # type: ignore[union-attr]
