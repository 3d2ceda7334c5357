"""The model a job trains and its batch: the type the policies, the simulator and the coordinator share.

**Batch rule** (the batch grows with the GPU count, so every rank of every
plan has samples): a job's global batch is

1. the trace's own batch (the Pollux workloads' ``batch_size`` column) when
   the mapping entry says ``"trace_batch": true`` — only then is the model
   the application whose samples the column counts (an ncf batch of 32,768
   is not 32,768 gpt2 sequences);
2. else ``per_gpu_batch × GPUs`` — the examples' per-GPU batch is their
   reference global batch at 8 GPUs over 8 (vgg16 16, resnet50 32,
   inception 32, gpt2 8), a mapping entry may give ``per_gpu_batch``;
3. else the mapping entry's fixed ``global_batch``.

A job whose batch is smaller than its GPU count is refused: some of its GPUs
would hold no sample, and no policy may be credited for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from deeppool.errors import DeeppoolError

if TYPE_CHECKING:
    from deeppool.plans import ModelSpec


@dataclass(frozen=True, kw_only=True)
class ModelChoice:
    """A model file and the global batch one job trains it with (strong scaling within the job).

    The file is only a path here: torch is imported (by :attr:`spec`) only when a Plan must be solved.
    """

    name: str
    path: Path
    global_batch: int
    per_gpu_batch: int | None = None
    """When set, a job on G GPUs trains at ``per_gpu_batch × G`` (the batch rule above)."""
    trace_batch: bool = False
    """Whether the trace's batch column is in this model's samples (the batch rule above)."""

    def __post_init__(self) -> None:
        if self.global_batch < 1 or (self.per_gpu_batch is not None and self.per_gpu_batch < 1):
            raise DeeppoolError(f"model '{self.name}': global_batch and per_gpu_batch must be >= 1")

    @property
    def spec(self) -> ModelSpec:
        """The planner's model spec (imports torch: needed only to trace and solve)."""
        from deeppool.plans import ModelSpec

        return ModelSpec.parse(str(self.path))

    def batch_for(self, gpus: int, trace_batch: int | None) -> int:
        """The global batch of a job on ``gpus`` GPUs (the batch rule)."""
        if self.trace_batch and trace_batch is not None:
            return trace_batch
        if self.per_gpu_batch is not None:
            return self.per_gpu_batch * gpus
        return self.global_batch
