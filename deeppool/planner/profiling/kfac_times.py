"""K-FAC's work per layer, timed on this host (``deeppool plan --optimizer kfac`` with a profile measured here).

For each preconditioned layer's factor sizes (``a``, ``o``, positions ``L``) at the global batch ``B`` on
one rank: the statistics (the two Gram matrices of ``B·L`` rows), both eigendecompositions, and the
preconditioning (four matmuls with the eigenvectors), each the fastest of a few runs on random data (another
process's work only slows a run down), with the profile's intra-op threads. Layers of the same sizes are
timed once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from deeppool.planner.profiling.timing import intra_op_threads, timed

Sizes = tuple[int, int, int]
"""A layer's ``(a, o, L)``: its factors' sizes and its output positions per sample."""


@dataclass(frozen=True)
class KfacTimes:
    """Milliseconds of one layer's K-FAC work on one rank at the global batch."""

    statistics_ms: float
    inverses_ms: float
    precondition_ms: float


def measure_kfac(sizes: Mapping[str, Sizes], batch: int, *, threads: int | None = None,
                 repeats: int = 5) -> dict[str, KfacTimes]:
    """Each layer's :class:`KfacTimes` (by layer name), timed here on the CPU."""
    found: dict[Sizes, KfacTimes] = {}
    with intra_op_threads(threads):
        for shape in dict.fromkeys(sizes.values()):
            found[shape] = _measure(shape, batch, repeats)
    return {name: found[shape] for name, shape in sizes.items()}


def _measure(shape: Sizes, batch: int, repeats: int) -> KfacTimes:
    a, o, positions = shape
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(batch * positions, a, generator=generator)
    grads = torch.randn(batch * positions, o, generator=generator)
    factor_a, factor_g = inputs.t() @ inputs / len(inputs), grads.t() @ grads / len(grads)
    qa, qg = torch.linalg.eigh(factor_a)[1], torch.linalg.eigh(factor_g)[1]
    grad = torch.randn(o, a, generator=generator)
    return KfacTimes(
        statistics_ms=_fastest(lambda: (inputs.t() @ inputs, grads.t() @ grads), repeats),
        inverses_ms=_fastest(lambda: (torch.linalg.eigh(factor_a), torch.linalg.eigh(factor_g)), repeats),
        precondition_ms=_fastest(lambda: qg @ (qg.t() @ grad @ qa) @ qa.t(), repeats),
    )


def _fastest(work: Callable[[], object], repeats: int) -> float:
    cpu = torch.device("cpu")
    timed(cpu, work)
    return min(timed(cpu, work)[0] for _ in range(repeats))
