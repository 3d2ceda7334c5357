"""Typed configuration of a run (validated at construction)."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from deeppool.errors import DeeppoolError

if TYPE_CHECKING:  # torch loads when an optimizer is built: the CLI checks options without it
    import torch


class Backend(enum.Enum):
    AUTO = "auto"
    GLOO = "gloo"
    NCCL = "nccl"

    def resolve(self, cuda_available: bool) -> Backend:
        """AUTO is NCCL when CUDA is available, else gloo."""
        if self is not Backend.AUTO:
            return self
        return Backend.NCCL if cuda_available else Backend.GLOO


class OptimizerKind(enum.Enum):
    SGD = "sgd"
    ADAM = "adam"


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    kind: OptimizerKind = OptimizerKind.SGD
    lr: float = 0.01
    momentum: float = 0.0

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise DeeppoolError(f"--lr {self.lr} must be positive")
        if not 0 <= self.momentum < 1:
            raise DeeppoolError(f"--momentum {self.momentum} must be in [0, 1)")

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        import torch

        params = list(params)
        if self.kind is OptimizerKind.ADAM:
            return torch.optim.Adam(params, lr=self.lr)
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """How to run a plan: steps, optimizer, backend, timeouts, checking, outputs."""

    steps: int = 50
    warmup: int = 5
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    backend: Backend = Backend.AUTO
    timeout_s: float = 300.0
    bucket_mb: float = 25.0
    check: bool = False
    check_bound: float = 1e-3
    out_dir: Path | None = None

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise DeeppoolError(f"--steps {self.steps} must be at least 1")
        if self.warmup < 0:
            raise DeeppoolError(f"--warmup {self.warmup} must be >= 0")
        if self.timeout_s <= 0:
            raise DeeppoolError(f"--timeout {self.timeout_s} must be positive")
        if self.bucket_mb < 0:
            raise DeeppoolError(f"--bucket-mb {self.bucket_mb} must be >= 0")
        if self.check_bound <= 0:
            raise DeeppoolError(f"--check-bound {self.check_bound} must be positive")

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2**20)


DEFAULT_SIZES = (4 * 2**10, 64 * 2**10, 2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20)
"""Message sizes in bytes: 4 KiB to 64 MiB (a reshard of a few samples to a large gradient bucket)."""


@dataclass(frozen=True, kw_only=True)
class ProbeConfig:
    """What to measure: ranks, message sizes (bytes), repeats, warm-up runs, timeout."""

    nproc: int = 2
    sizes: tuple[int, ...] = DEFAULT_SIZES
    repeats: int = 10
    warmup: int = 3
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.nproc < 2:
            raise DeeppoolError(f"--nproc {self.nproc}: measuring a network needs at least 2 processes")
        if not self.sizes or min(self.sizes) < 4:
            sizes = ",".join(map(str, self.sizes))
            raise DeeppoolError(f"--sizes {sizes}: every message size must be at least 4 bytes")
        if self.repeats < 1:
            raise DeeppoolError(f"--repeats {self.repeats} must be at least 1")
        if self.warmup < 0:
            raise DeeppoolError(f"--warmup {self.warmup} must be >= 0")
