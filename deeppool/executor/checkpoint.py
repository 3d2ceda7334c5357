"""Checkpoints: every rank writes its own shard; a checkpoint counts once every shard is written.

``<dir>/step-<N>/rank<r>.pt`` holds what rank ``r`` trains: the parameters and
buffers of its layers (by their names in the model), its optimizer's and LR
schedule's state, the fp16 loss scale and its growth count (``--precision
fp16``), ``N``, the number of optimizer steps done, and the data position: the
global batches consumed (with ``--data``, epoch ``⌊n / N_e⌋``, batch ``n mod
N_e`` of :class:`~deeppool.executor.data.EpochOrder`). Per-sample random
draws are seeded by the step, so a resumed run continues exactly where the
interrupted one was. A shard is written to a temporary
file and renamed into place; after every rank has written (a barrier), rank 0
writes ``COMPLETE``. A rank killed mid-write leaves no ``COMPLETE`` in that
step's directory, so :func:`latest` still finds the previous checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deeppool.errors import DeeppoolError

MARKER = "COMPLETE"


@dataclass(frozen=True, kw_only=True)
class Shard:
    """One rank's part of a checkpoint."""

    steps_done: int
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    data_position: int | None = None
    """Global batches consumed (None in checkpoints written before it was recorded: ``steps_done × K``)."""
    scaler: dict[str, Any] | None = None
    """The fp16 loss scaler's state (:class:`~deeppool.executor.precision.AgreedScaler`)."""

    def to_dict(self) -> dict[str, Any]:
        return {"steps_done": self.steps_done, "params": self.params, "buffers": self.buffers,
                "optimizer": self.optimizer, "scheduler": self.scheduler, "data_position": self.data_position,
                "scaler": self.scaler}


def step_dir(directory: Path, steps_done: int) -> Path:
    return directory / f"step-{steps_done:08d}"


def save(directory: Path, rank: int, shard: Shard, barrier: Callable[[], None]) -> Path:
    """Write ``shard`` atomically; after ``barrier`` (every rank has written) rank 0 marks it complete."""
    target = step_dir(directory, shard.steps_done)
    target.mkdir(parents=True, exist_ok=True)
    _atomic(target / f"rank{rank}.pt", lambda path: torch.save(shard.to_dict(), path))
    barrier()
    if rank == 0:
        _atomic(target / MARKER, lambda path: path.write_text(f"{shard.steps_done}\n"))
    return target


def latest(directory: Path) -> int | None:
    """The steps done by the newest complete checkpoint, or None."""
    done = [int(path.parent.name.split("-")[1]) for path in directory.glob(f"step-*/{MARKER}")]
    return max(done, default=None)


def load(directory: Path, steps_done: int, rank: int) -> Shard:
    path = step_dir(directory, steps_done) / f"rank{rank}.pt"
    if not path.is_file():
        raise DeeppoolError(f"checkpoint '{path.parent}' has no shard for rank {rank}: was it written by this plan?")
    data = torch.load(path, map_location="cpu", weights_only=False)
    return Shard(**data)


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    write(temporary)
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, path)
