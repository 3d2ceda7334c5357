"""How a background job sharing a foreground job's GPUs affects both.

A background job placed on ``k`` lent ranks of foreground jobs progresses at

    rate_bg = bg_efficiency · min_i(idle_i) / T_bg(k)

iterations per second, ``idle_i`` being the idle fraction of lent rank ``i`` in
the foreground Plan (its idle windows over its iteration time) and ``T_bg(k)``
the background job's own data-parallel iteration time on ``k`` GPUs. A
foreground job that hosts at least one background job runs at
``T_fg · fg_slowdown``. Ranks idle for less than ``min_lend_fraction`` of an
iteration are not lent.

The defaults are assumptions, not measurements (docs/simulator.md): DeepPool
(Park et al., MLSys 2022, §5) multiplexes with CUDA stream priorities and
CUDA graphs so that the foreground keeps its speed to within a few percent,
and background kernels fill most but not all of the idle windows because of
launch latency and window fragmentation. ``deeppool multiplex bench`` measures
both (``interference.json``); :meth:`InterferenceModel.measured` reads that
file in their place (``deeppool simulate --interference FILE``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from deeppool.errors import DeeppoolError

DEFAULT_FG_SLOWDOWN = 1.05
DEFAULT_BG_EFFICIENCY = 0.8
DEFAULT_MIN_LEND_FRACTION = 0.1


@dataclass(frozen=True, kw_only=True)
class InterferenceModel:
    fg_slowdown: float = DEFAULT_FG_SLOWDOWN
    bg_efficiency: float = DEFAULT_BG_EFFICIENCY
    min_lend_fraction: float = DEFAULT_MIN_LEND_FRACTION

    def __post_init__(self) -> None:
        if self.fg_slowdown < 1:
            raise DeeppoolError(f"--fg-slowdown {self.fg_slowdown} is below 1: it multiplies the iteration time")
        if not 0 < self.bg_efficiency <= 1:
            raise DeeppoolError(f"--bg-efficiency {self.bg_efficiency} must be in (0, 1]")
        if not 0 <= self.min_lend_fraction <= 1:
            raise DeeppoolError(f"--min-lend-fraction {self.min_lend_fraction} must be in [0, 1]")

    @classmethod
    def measured(cls, path: Path, *, min_lend_fraction: float = DEFAULT_MIN_LEND_FRACTION) -> InterferenceModel:
        """The slowdown and efficiency ``deeppool multiplex bench`` wrote to ``interference.json``."""
        try:
            data = json.loads(path.read_text())
            slowdown, efficiency = float(data["fg_slowdown"]), float(data["bg_efficiency"])
        except FileNotFoundError:
            raise DeeppoolError(f"--interference '{path}' does not exist: write it with `deeppool multiplex bench`") from None
        except (ValueError, KeyError, TypeError):
            raise DeeppoolError(f"--interference '{path}' is not an interference.json from `deeppool multiplex bench` "
                                "(needs fg_slowdown and bg_efficiency)") from None
        return cls(fg_slowdown=max(1.0, slowdown), bg_efficiency=min(1.0, max(efficiency, 1e-3)),
                   min_lend_fraction=min_lend_fraction)
