"""Typed configuration of a run (validated at construction)."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from deeppool.errors import DeeppoolError
from deeppool.executor.comm import Backend


class OptimizerKind(enum.Enum):
    SGD = "sgd"
    ADAM = "adam"


DEFAULT_TIMEOUT_S = 60.0
"""Seconds before a stalled communication fails: a hung rank is named about this long after it stops."""

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
    timeout_s: float = DEFAULT_TIMEOUT_S
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
