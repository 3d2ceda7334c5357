"""The global batch as a decision: plan every candidate batch, keep the one with the best goodput.

For each candidate global batch ``B`` the planner solves its ILP (the same cost
model and search as a fixed batch), giving the iteration time ``t(B)``. Then

    throughput(B) = B / t(B)                       (samples/s)
    E(B)          = (φ + B₀) / (φ + B)             (Pollux's statistical efficiency)
    goodput(B)    = throughput(B) · E(B)           (base-batch samples/s)

with ``φ`` the gradient noise scale (``--gns``) and ``B₀`` the base batch.
``B₀`` scales every goodput alike, so the chosen batch does not depend on it.
The model is traced once; each batch gets its own profile (profiles are per
per-GPU batch), estimated or measured (measurements are cached).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from deeppool.adaptation.goodput import statistical_efficiency
from deeppool.errors import DeeppoolError
from deeppool.plans import BatchChoice, GoodputSearch

if TYPE_CHECKING:
    from deeppool.planner.api import Planned

MAX_CANDIDATES = 8
"""Default search: the base batch and its doublings, this many at most."""
MAX_SAMPLES_PER_GPU = 256
"""Default search: no candidate above this many samples per GPU."""


@dataclass(frozen=True, kw_only=True)
class BatchSearchRequest:
    """What ``deeppool plan --batch auto`` searches: candidate batches, the noise scale, the base batch."""

    gpus: int
    noise_scale: float
    base_batch: int | None = None
    batches: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not self.noise_scale > 0:
            raise DeeppoolError(f"--gns {self.noise_scale}: give the gradient noise scale in samples, above 0")
        if self.base_batch is not None and self.base_batch < 1:
            raise DeeppoolError(f"--base-batch {self.base_batch}: give a positive batch size")
        small = [b for b in self.batches if b < self.gpus]
        if small:
            raise DeeppoolError(f"--batches {small[0]} is below --gpus {self.gpus}: every GPU needs a sample; "
                                f"give batches of at least {self.gpus}")

    def candidates(self) -> tuple[int, ...]:
        """``--batches``, else powers of two from the base batch (or the GPU count) up, at most 256 per GPU."""
        if self.batches:
            return tuple(sorted(set(self.batches)))
        start = max(self.base_batch or 1, self.gpus)
        first = 1 << (start - 1).bit_length()
        top = max(first, self.gpus * MAX_SAMPLES_PER_GPU)
        return tuple(first << k for k in range(MAX_CANDIDATES) if first << k <= top)

    def base(self) -> int:
        return self.base_batch or self.candidates()[0]


def search_batches(
    solve: Callable[[int], Planned], search: BatchSearchRequest, *, on_solved: Callable[[int], None] = lambda b: None,
    on_stopped: Callable[[int, str], None] = lambda b, why: None,
) -> tuple[Planned, GoodputSearch]:
    """Solve every candidate (``solve(batch)``), return the goodput-optimal plan with the search recorded.

    A candidate the planner cannot place (memory) ends the search upwards when a smaller one was planned
    (``on_stopped(batch, reason)``).
    """
    planned: dict[int, Planned] = {}
    for batch in search.candidates():
        try:
            planned[batch] = solve(batch)
        except DeeppoolError as err:
            if not planned:
                raise
            on_stopped(batch, str(err))
            break
        on_solved(batch)
    base = search.base()
    choices = tuple(
        BatchChoice(batch=b, iteration_s=p.plan.predicted.iteration_ms / 1e3,
                    efficiency=statistical_efficiency(b, base_batch=base, noise_scale=search.noise_scale),
                    gpus=max(layer.gpus for layer in p.plan.layers))
        for b, p in planned.items()
    )
    result = GoodputSearch(noise_scale=search.noise_scale, base_batch=base, choices=choices)
    winner = planned[result.chosen.batch]
    return replace(winner, plan=replace(winner.plan, goodput=result)), result


def plot(result: GoodputSearch, path: str | Path) -> None:
    """A PNG of goodput and throughput against the global batch (log2 axis), the chosen batch marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = [c.batch for c in result.choices]
    figure, axes = plt.subplots(figsize=(8, 5))
    axes.plot(batches, [c.throughput for c in result.choices], "--s", color="#888888", label="throughput (samples/s)")
    axes.plot(batches, [c.goodput for c in result.choices], "-o", color="#4C72B0",
              label=f"goodput (base-batch samples/s, φ = {result.noise_scale:g}, B₀ = {result.base_batch})")
    chosen = result.chosen
    axes.plot([chosen.batch], [chosen.goodput], "*", color="#DD8452", markersize=16, linestyle="none",
              label=f"best goodput: batch {chosen.batch}")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("global batch (log2)")
    axes.set_ylabel("samples per second")
    axes.set_title("goodput = throughput × statistical efficiency, per planned batch")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def table(result: GoodputSearch):
    """A rich table: batch, iteration time, throughput, efficiency, goodput, GPUs used; the best row marked."""
    from rich.table import Table

    shown = Table(title=f"goodput per global batch (noise scale {result.noise_scale:g}, base batch "
                        f"{result.base_batch})")
    for column in ("batch", "iteration (ms)", "throughput (samples/s)", "efficiency E", "goodput", "GPUs used"):
        shown.add_column(column, justify="right")
    chosen = result.chosen.batch
    for c in result.choices:
        shown.add_row(f"{c.batch}{' *' if c.batch == chosen else ''}", f"{c.iteration_s * 1e3:.2f}",
                      f"{c.throughput:,.0f}", f"{c.efficiency:.3f}", f"{c.goodput:,.0f}", str(c.gpus),
                      style="bold" if c.batch == chosen else None)
    return shown
