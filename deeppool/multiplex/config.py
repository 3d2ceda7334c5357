"""Typed configuration of a background job and of how it shares the foreground's devices."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deeppool import options
from deeppool.errors import DeeppoolError
from deeppool.executor.config import OptimizerConfig
from deeppool.options import nested, option
from deeppool.planner.profiling.interference import DEFAULT_PIECE_MS
from deeppool.plans import Optimizer

PRIORITY_PIECE_MS = DEFAULT_PIECE_MS
"""``priority`` mode's default piece: the target length in ms of each CUDA graph the background step is cut
into, at layer boundaries (DeepPool's ``be_graph_split_ms``, 0.5 ms; :mod:`deeppool.multiplex.pieces`). A
piece is closed before it would pass the target, so every piece is at most this long unless one layer phase
of one row is longer (the step is cut into micro-steps of fewer rows where a layer of the whole batch is);
a window of at least this length then holds the next piece. The value is defined once, beside the
simulator's and the planner's model of pieces (``interference.DEFAULT_PIECE_MS``, which imports neither
torch nor the executor); ``--piece-ms`` changes it for a run (:attr:`BackgroundConfig.piece_ms`), and
:attr:`MuxMode.piece_ms` is what a mode assumes by default."""


class MuxMode(enum.Enum):
    """How background work is kept out of the foreground's way."""

    NONE = "none"  # plain time-slicing: a background process at normal priority (the baseline)
    SCHED_IDLE = "sched_idle"  # a background process under SCHED_IDLE, not gated
    GATE = "gate"  # a SCHED_IDLE process that works only inside idle windows (a token per window)
    PRIORITY = "priority"  # GPU: a thread in the rank's process, low-priority stream, CUDA-graph pieces
    MPS = "mps"  # GPU: a background process as an MPS client with an active-thread percentage

    @property
    def needs_gpu(self) -> bool:
        return self in (MuxMode.PRIORITY, MuxMode.MPS)

    @property
    def gated(self) -> bool:
        """Whether work is admitted only into idle windows (else the process runs freely)."""
        return self in (MuxMode.GATE, MuxMode.PRIORITY)

    @property
    def in_process(self) -> bool:
        return self is MuxMode.PRIORITY

    @property
    def piece_ms(self) -> float | None:
        """The default length of the indivisible pieces this mode lends windows in: :data:`PRIORITY_PIECE_MS`
        for ``priority``. None for the others: ``gate`` sizes each micro-step (whole rows of the batch) to
        the window it runs in, and the free-running modes do not work in windows."""
        return PRIORITY_PIECE_MS if self is MuxMode.PRIORITY else None


CPU_MODES = (MuxMode.NONE, MuxMode.SCHED_IDLE, MuxMode.GATE)
GPU_MODES = (MuxMode.NONE, MuxMode.PRIORITY, MuxMode.MPS)


@dataclass(frozen=True, kw_only=True)
class ABSchedule:
    """Interleaved A/B: after ``warmup`` steps alone, blocks of ``block`` steps alternate alone / shared.

    The first step of every block is a transition and is left out of the comparison.
    """

    warmup: int = 3
    block: int = option(4, flag="--ab-block", help="A/B: steps per alone or shared block")

    def __post_init__(self) -> None:
        if self.warmup < 1:
            raise DeeppoolError(f"--ab-warmup {self.warmup} must be at least 1 (a baseline before sharing)")
        if self.block < 2:
            raise DeeppoolError(f"--ab-block {self.block} must be at least 2 (one transition step, one measured)")

    def shared(self, step: int) -> bool:
        """Whether the background may work during ``step``."""
        return step >= self.warmup and ((step - self.warmup) // self.block) % 2 == 1

    def measured(self, step: int) -> bool:
        return step >= self.warmup and (step - self.warmup) % self.block != 0


BACKGROUND_KEY = "background"
"""Where the background's config is in the file every rank reads (:class:`~deeppool.executor.config.RankConfig`)."""


@dataclass(frozen=True, kw_only=True)
class BackgroundConfig:
    """A background training job: a model file, a batch, an optimizer, and how it shares the device."""

    model: Path = option(flag="--background", help="background model file: trains in the plan's idle windows")
    batch: int = option(8, flag="--bg-batch", help="background batch size")
    optimizer: OptimizerConfig = nested(default_factory=OptimizerConfig, prefix="bg-", help_prefix="background ",
                                        only=("kind", "lr"))
    mode: MuxMode = option(MuxMode.GATE, flag="--mux", help="how background work keeps out of the foreground's way")
    checkpoint_dir: Path | None = option(None, flag="--bg-checkpoint-dir", help="where the background job "
                                         "checkpoints and resumes (default: OUT/background)")
    checkpoint_every: int = 50
    slowdown_target: float = option(0.05, help="foreground slowdown the controller aims under (fraction)")
    mps_percentage: int = option(30, help="--mux mps: the background client's active-thread percentage")
    piece_ms: float = option(PRIORITY_PIECE_MS, help="--mux priority: target length (ms) of the CUDA-graph pieces "
                             "the background step is cut into, at layer boundaries")
    min_window_ms: float = 1.0
    """Shorter windows are not lent: waking and stopping the background costs more than it could do."""
    schedule: ABSchedule = nested(default_factory=ABSchedule)
    seed: int = 0
    preflight_apart: bool = False
    """Load the model for the memory check in a process of its own (the coordinator: a guest's code never
    runs in its host's processes); else in this one (``deeppool run``: one user's own jobs, no start-up cost)."""
    broker: Path | None = None
    """A coordinator's guest of another account: the socket of the host supervisor's broker, which starts the
    background's processes as the guest's account (:mod:`deeppool.multiplex.remote`); ``gate`` mode only."""

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise DeeppoolError(f"--bg-batch {self.batch} must be at least 1")
        if self.optimizer.kind is Optimizer.KFAC:
            raise DeeppoolError("--bg-optimizer kfac: a background job trains with sgd or adam")
        if self.checkpoint_every < 1:
            raise DeeppoolError(f"--bg-checkpoint-every {self.checkpoint_every} must be at least 1")
        if not 0 < self.slowdown_target < 1:
            raise DeeppoolError(f"--slowdown-target {self.slowdown_target} must be in (0, 1), e.g. 0.05")
        if self.min_window_ms < 0:
            raise DeeppoolError(f"min_window_ms {self.min_window_ms} must be at least 0")
        if self.broker is not None and self.mode is not MuxMode.GATE:
            raise DeeppoolError(f"a guest of another account runs in --mux gate, not {self.mode.value}")
        if not 1 <= self.mps_percentage <= 100:
            raise DeeppoolError(f"--mps-percentage {self.mps_percentage} must be in [1, 100]")
        if not self.piece_ms > 0:
            raise DeeppoolError(f"--piece-ms {self.piece_ms} must be positive, e.g. {PRIORITY_PIECE_MS}")

    def checkpoint(self, rank: int) -> Path | None:
        if self.checkpoint_dir is None:
            return None
        return self.checkpoint_dir / f"background-rank{rank}.pt"

    def to_json(self) -> dict[str, Any]:
        return options.to_json(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> BackgroundConfig:
        return options.from_json(cls, data, where="background config")
