"""Which ranks of a running foreground Plan are lent to background work: one rule for the simulator and the
coordinator.

A rank is lent when it is idle for at least the interference model's ``min_lend_fraction`` of an iteration
and background work can fill some of its windows (:meth:`InterferenceModel.usable_fraction` > 0). Its
:class:`~deeppool.scheduling.contract.Slot` carries its idle and usable fractions, its longest usable window
and the memory its host's rank leaves; slots come most idle first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from deeppool.planner.profiling.interference import InterferenceModel
from deeppool.scheduling.contract import Slot


def lendable_slots(host: int, idle: Sequence[float], windows_ms: Callable[[int], tuple[float, ...]],
                   iteration_ms: float, model: InterferenceModel, *,
                   free_memory: Callable[[int], int] = lambda rank: 2**62) -> list[Slot]:
    """The lent ranks of ``host``'s Plan: ``idle[r]`` is rank r's idle fraction, ``windows_ms(r)`` its idle
    windows (ms), ``free_memory(r)`` the memory its host's rank leaves."""
    ranks = sorted(range(len(idle)), key=lambda r: -idle[r])
    usable = {r: model.usable_fraction(windows_ms(r), iteration_ms, piece_ms=model.bg_piece_ms) for r in ranks}
    return [
        Slot(host=host, rank=r, idle_fraction=idle[r], usable_fraction=usable[r],
             longest_window_ms=model.longest_usable_window_ms(windows_ms(r), iteration_ms),
             free_memory_bytes=free_memory(r))
        for r in ranks
        if idle[r] >= model.min_lend_fraction and usable[r] > 0
    ]
