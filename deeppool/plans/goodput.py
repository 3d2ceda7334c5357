"""The global batch chosen for goodput (``--batch auto``): every candidate's planned figures."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from deeppool.errors import DeeppoolError


@dataclass(frozen=True, kw_only=True)
class BatchChoice:
    batch: int
    iteration_s: float
    efficiency: float
    gpus: int = 0
    """GPUs the plan for this batch uses (0: not recorded)."""

    @property
    def throughput(self) -> float:
        """Samples per second."""
        return self.batch / self.iteration_s

    @property
    def goodput(self) -> float:
        """Base-batch-equivalent samples per second."""
        return self.throughput * self.efficiency


@dataclass(frozen=True, kw_only=True)
class GoodputSearch:
    """A search over global batches: each candidate's planned figures, and which one has the best goodput."""

    noise_scale: float
    base_batch: int
    choices: tuple[BatchChoice, ...]

    @property
    def chosen(self) -> BatchChoice:
        return best(self.choices)

    def to_json(self) -> dict[str, object]:
        return {"noise_scale": self.noise_scale, "base_batch": self.base_batch, "chosen_batch": self.chosen.batch,
                "choices": [{"batch": c.batch, "iteration_s": c.iteration_s, "efficiency": c.efficiency,
                             "gpus": c.gpus, "throughput": c.throughput, "goodput": c.goodput}
                            for c in self.choices]}

    @classmethod
    def from_json(cls, data: dict) -> GoodputSearch:
        return cls(noise_scale=float(data["noise_scale"]), base_batch=int(data["base_batch"]),
                   choices=tuple(BatchChoice(batch=int(c["batch"]), iteration_s=float(c["iteration_s"]),
                                             efficiency=float(c["efficiency"]), gpus=int(c["gpus"]))
                                 for c in data["choices"]))


def best(choices: Iterable[BatchChoice]) -> BatchChoice:
    choices = list(choices)
    if not choices:
        raise DeeppoolError("no batch size to choose from: give at least one candidate")
    return max(choices, key=lambda c: c.goodput)
