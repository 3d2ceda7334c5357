"""The background training loop: a model file trained in bounded pieces, checkpointed and resumable.

A step trains on one batch of ``batch`` samples (the model file's ``inputs`` /
``targets``, each called with the torch RNG seeded by ``seed`` and the step
number, so the two can draw matching rows and a resumed job sees the same data). A step can be cut into *micro-steps* of
any number of rows: gradients accumulate, each loss weighted by its share of
the batch, and the optimizer steps when the batch is complete — how a gated
background fits its work into windows shorter than a whole step. Checkpoints
are written atomically (a temporary file, then ``os.replace``) at step
boundaries and hold the model, the optimizer and the step.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deeppool.errors import DeeppoolError
from deeppool.executor.config import OptimizerConfig
from deeppool.model.loading import LoadedModel, load_model
from deeppool.plans import ModelSpec


@dataclass(frozen=True, kw_only=True)
class Piece:
    """What one micro-step did."""

    rows: int
    seconds: float
    stepped: bool
    loss: float | None


def load_background(path: Path) -> LoadedModel:
    """The background model file, loaded as every model file is (a one-line error if it does not load)."""
    return load_model(ModelSpec.parse(str(path)))


def _slice(value: Any, start: int, end: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[start:end] if value.dim() > 0 else value
    if isinstance(value, dict):
        return {k: _slice(v, start, end) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_slice(v, start, end) for v in value)
    return value


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    return value


def forward(module: torch.nn.Module, inputs: Any) -> Any:
    """Keyword inputs (a dict) or positional ones."""
    if isinstance(inputs, dict):
        return module(**inputs)
    return module(*inputs)


class BackgroundJob:
    """One background model in training; :meth:`micro_step` is the unit of admitted work."""

    def __init__(
        self, loaded: LoadedModel, *, batch: int, optimizer: OptimizerConfig, seed: int = 0,
        device: torch.device | None = None, checkpoint: Path | None = None,
    ) -> None:
        self.loaded = loaded
        self.batch = batch
        self.seed = seed
        self.device = device or torch.device("cpu")
        self.module = loaded.module.to(self.device).train()
        self.optimizer = optimizer.build(self.module.parameters())
        self.checkpoint_path = checkpoint
        self.step = 0
        self.samples = 0
        self.losses: list[float] = []
        self._done_rows = 0
        self._data: tuple[Any, Any] | None = None
        self._loss_sum = 0.0
        if checkpoint is not None and checkpoint.exists():
            self._resume(checkpoint)

    # -- data ------------------------------------------------------------------------------------
    def _batch(self) -> tuple[Any, Any]:
        if self._data is None:
            seed = self.seed * 1_000_003 + self.step
            torch.manual_seed(seed)
            inputs = self.loaded.inputs(self.batch)
            torch.manual_seed(seed)
            targets = self.loaded.targets(self.batch)
            self._data = (_to(inputs, self.device), _to(targets, self.device))
        return self._data

    # -- training ----------------------------------------------------------------------------------
    def micro_step(self, rows: int | None = None) -> Piece:
        """Forward and backward on the next ``rows`` rows of the current batch; steps when it is done."""
        started = time.perf_counter()
        left = self.batch - self._done_rows
        rows = left if rows is None else max(1, min(rows, left))
        inputs, targets = self._batch()
        start, end = self._done_rows, self._done_rows + rows
        output = forward(self.module, _slice(inputs, start, end))
        loss = self.loaded.loss(output, _slice(targets, start, end))
        (loss * (rows / self.batch)).backward()
        self._loss_sum += float(loss.detach()) * rows / self.batch
        self._done_rows = end
        stepped = end == self.batch
        finished = None
        if stepped:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            finished = self._loss_sum
            self.losses.append(finished)
            self.step += 1
            self.samples += self.batch
            self._done_rows, self._data, self._loss_sum = 0, None, 0.0
        return Piece(rows=rows, seconds=time.perf_counter() - started, stepped=stepped, loss=finished)

    def warm_up(self, rows: int = 2) -> float:
        """Two passes of forward and backward on ``rows`` rows of the first batch that leave everything the job
        trains with as it was (weights, buffers, gradients, optimizer, RNG, data), so that a first pass's
        one-time costs (autograd's, the allocator's) fall before any window; returns the warm pass's CPU
        seconds per row, the first estimate a gated worker sizes its pieces by."""
        if self._done_rows:
            raise RuntimeError("a background job warms up at a step boundary, not inside a batch")
        rows = max(1, min(rows, self.batch))
        buffers = [b.clone() for b in self.module.buffers()]
        cuda = [self.device] if self.device.type == "cuda" else []
        seconds = 0.0
        with torch.random.fork_rng(devices=cuda):
            inputs, targets = self._batch()
            for _ in range(2):
                cpu = time.process_time()
                self.loaded.loss(forward(self.module, _slice(inputs, 0, rows)), _slice(targets, 0, rows)).backward()
                seconds = time.process_time() - cpu
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for buffer, saved in zip(self.module.buffers(), buffers, strict=True):
                buffer.copy_(saved)
        self._data = None
        return seconds / rows

    def train_step(self) -> float:
        """One whole step (the rest of the current batch); returns its loss."""
        while True:
            piece = self.micro_step()
            if piece.stepped:
                assert piece.loss is not None
                return piece.loss

    # -- checkpoints -----------------------------------------------------------------------------
    def save(self, path: Path | None = None) -> Path | None:
        """Write a checkpoint atomically (at the last completed step); returns its path."""
        path = path or self.checkpoint_path
        if path is None:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {"step": self.step, "samples": self.samples, "model": self.module.state_dict(),
                 "optimizer": self.optimizer.state_dict(), "losses": self.losses[-1000:]}
        if self._done_rows:  # mid-batch: the accumulated gradients are not part of the checkpoint
            state["note"] = "saved mid-batch; resumes at the start of the step"
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        torch.save(state, tmp)
        os.replace(tmp, path)
        return path

    def _resume(self, path: Path) -> None:
        try:
            state = torch.load(path, map_location=self.device, weights_only=False)
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except Exception as err:
            raise DeeppoolError(f"background checkpoint '{path}' does not load: {type(err).__name__}: {err}; "
                                "delete it to start over") from None
        self.step, self.samples = int(state["step"]), int(state["samples"])
        self.losses = list(state.get("losses", []))
