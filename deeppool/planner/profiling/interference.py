"""How a background job sharing a foreground job's GPUs affects both.

A background job placed on ``k`` lent ranks of foreground jobs progresses at

    rate_bg = min_i(usable_i) / T_bg(k),   usable_i = Σ_w e(len_w) · len_w / T_fg

iterations per second: ``len_w`` runs over the idle windows of lent rank ``i``
in the foreground Plan, ``e(len)`` is the background's efficiency in a window
of that length (the share of it turned into background work) and ``T_bg(k)``
the background job's own data-parallel iteration time on ``k`` GPUs. With no
measured curve, ``e`` is the constant ``bg_efficiency``. A measured curve
(``efficiency_by_window_ms`` of ``interference.json``: efficiency per
power-of-two bin of window length, by the bin's lower edge) gives each window
its bin's efficiency; windows shorter than the shortest bin measured get 0
(the multiplexer does not lend them), longer ones the longest bin's. A
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

import bisect
import enum
import json
import math
from dataclasses import dataclass
from pathlib import Path

from deeppool.errors import DeeppoolError

DEFAULT_FG_SLOWDOWN = 1.05
DEFAULT_BG_EFFICIENCY = 0.8
DEFAULT_MIN_LEND_FRACTION = 0.1
DEFAULT_PIECE_MS = 0.5
"""``priority`` mode's target piece: DeepPool's ``be_graph_split_ms`` (``GraphPieces.cpp``), 0.5 ms."""
_WHOLE = 1e-9
"""A window this close to the iteration's length is the whole iteration (the times are sums of floats)."""


@dataclass(frozen=True, kw_only=True)
class InterferenceModel:
    fg_slowdown: float = DEFAULT_FG_SLOWDOWN
    bg_efficiency: float = DEFAULT_BG_EFFICIENCY
    min_lend_fraction: float = DEFAULT_MIN_LEND_FRACTION
    efficiency_by_window_ms: tuple[tuple[float, float], ...] = ()
    """(bin's lower edge in ms, efficiency), sorted by edge; empty: ``bg_efficiency`` for every window."""
    bg_piece_ms: float = 0.0
    """The background job's indivisible step piece, for the plans chosen to host it (``--objective cluster``):
    a window holds only whole pieces (:meth:`usable_fraction`); 0: any length is filled."""

    def __post_init__(self) -> None:
        if self.fg_slowdown < 1:
            raise DeeppoolError(f"--fg-slowdown {self.fg_slowdown} is below 1: it multiplies the iteration time")
        if not 0 < self.bg_efficiency <= 1:
            raise DeeppoolError(f"--bg-efficiency {self.bg_efficiency} must be in (0, 1]")
        if not 0 <= self.min_lend_fraction <= 1:
            raise DeeppoolError(f"--min-lend-fraction {self.min_lend_fraction} must be in [0, 1]")
        if not self.bg_piece_ms >= 0:
            raise DeeppoolError(f"background piece of {self.bg_piece_ms} ms must be at least 0")
        edges = [edge for edge, _ in self.efficiency_by_window_ms]
        if edges != sorted(set(edges)) or any(not 0 <= e <= 1 for _, e in self.efficiency_by_window_ms):
            raise DeeppoolError("efficiency_by_window_ms needs increasing window lengths and efficiencies in [0, 1]")

    def efficiency(self, window_ms: float) -> float:
        """The share of an idle window of ``window_ms`` that background work fills."""
        curve = self.efficiency_by_window_ms
        if not curve:
            return self.bg_efficiency
        index = bisect.bisect_right([edge for edge, _ in curve], window_ms) - 1
        return curve[index][1] if index >= 0 else 0.0

    @property
    def max_efficiency(self) -> float:
        """The most any window yields: ``e(len) ≤ max_efficiency`` for every length (the planner's bound)."""
        return max((e for _, e in self.efficiency_by_window_ms), default=0.0) if self.efficiency_by_window_ms \
            else self.bg_efficiency

    def usable_fraction(self, windows_ms: tuple[float, ...], iteration_ms: float, *, piece_ms: float = 0.0) -> float:
        """The share of an iteration a lent rank turns into background work: Σ_w e(len_w) · fit(len_w) / T.

        ``fit(len) = ⌊len / piece⌋ · piece``: a background job whose step comes in indivisible pieces of
        ``piece_ms`` (its longest kernel) fills only whole pieces of a window; ``piece_ms`` 0 fills all of it.
        A rank that runs no layer (:func:`idle_throughout`) is the exception: its one window runs into the next
        iteration's with no foreground work between them, so a piece may cross from one to the next and the
        whole window is filled (at its length's efficiency: the multiplexer still closes and opens it at every
        iteration).
        """
        if iteration_ms <= 0:
            return 0.0
        if idle_throughout(windows_ms, iteration_ms):
            piece_ms = 0.0
        return min(1.0, sum(self.efficiency(w) * _fit(w, piece_ms) for w in windows_ms) / iteration_ms)

    def longest_usable_window_ms(self, windows_ms: tuple[float, ...], iteration_ms: float) -> float:
        """The longest window background work is admitted to at all (0 when none is; unbounded on a rank that
        runs no layer, whose windows follow one another)."""
        if idle_throughout(windows_ms, iteration_ms):
            return math.inf if self.efficiency(windows_ms[0]) > 0 else 0.0
        return max((w for w in windows_ms if self.efficiency(w) > 0), default=0.0)

    @classmethod
    def measured(cls, path: Path, *, min_lend_fraction: float = DEFAULT_MIN_LEND_FRACTION) -> InterferenceModel:
        """The slowdown, efficiency and efficiency by window length ``deeppool multiplex bench`` wrote, and the
        piece of the mode it measured (``priority``: its ``piece_ms``, else 0.5 ms; the others': 0, since
        their pieces depend on the guest)."""
        try:
            data = json.loads(path.read_text())
            slowdown, efficiency = float(data["fg_slowdown"]), float(data["bg_efficiency"])
            curve = tuple(sorted((float(b["window_ms"]), min(1.0, max(0.0, float(b["efficiency"]))))
                                 for b in data.get("efficiency_by_window_ms", ())))
            piece = float(data.get("piece_ms", DEFAULT_PIECE_MS)) if data.get("mode") == PieceMode.PRIORITY.value \
                else 0.0
        except FileNotFoundError:
            raise DeeppoolError(f"--interference '{path}' does not exist: write it with `deeppool multiplex bench`") from None
        except (ValueError, KeyError, TypeError):
            raise DeeppoolError(f"--interference '{path}' is not an interference.json from `deeppool multiplex bench` "
                                "(needs fg_slowdown and bg_efficiency)") from None
        return cls(fg_slowdown=max(1.0, slowdown), bg_efficiency=min(1.0, max(efficiency, 1e-3)),
                   min_lend_fraction=min_lend_fraction, efficiency_by_window_ms=curve, bg_piece_ms=max(0.0, piece))


class PieceMode(enum.Enum):
    """The multiplexing mode that will run the background, which sets the piece a window must hold whole.

    ``priority`` (GPU): the step captured as CUDA graphs cut at layer boundaries, in micro-steps of whole
    rows, into pieces of a target length: a piece is the target, or one layer phase of one row where that
    is longer. ``gate`` (CPU): micro-steps of whole rows, the least one the whole step at one row.
    ``layer``: a whole layer phase at the guest's own batch (a runtime that cuts only between layers).
    """

    PRIORITY = "priority"
    GATE = "gate"
    LAYER = "layer"


@dataclass(frozen=True, kw_only=True)
class Pieces:
    """How the background's step is cut (``--mux``, ``--piece-ms``): the simulator's and the planner's piece."""

    mode: PieceMode = PieceMode.PRIORITY
    target_ms: float = DEFAULT_PIECE_MS
    """``priority``: the length pieces are cut to (``be_graph_split_ms``); unused by the other modes."""

    def __post_init__(self) -> None:
        if not self.target_ms > 0:
            raise DeeppoolError(f"--piece-ms {self.target_ms} must be above 0")

    def piece_ms(self, *, phase_ms: float, row_phase_ms: float, row_step_ms: float) -> float:
        """A guest's piece from its own data-parallel plans: ``phase_ms`` its longest layer phase at its batch,
        ``row_phase_ms`` and ``row_step_ms`` its longest layer phase and its step at one row."""
        if self.mode is PieceMode.PRIORITY:
            return max(self.target_ms, row_phase_ms)
        return row_step_ms if self.mode is PieceMode.GATE else phase_ms

    @property
    def planning_ms(self) -> float:
        """The piece plans are chosen for when the guest is not known (a trace's lending plans): the target in
        ``priority`` mode; 0 (any length) in the others, whose pieces depend on the guest."""
        return self.target_ms if self.mode is PieceMode.PRIORITY else 0.0

    def describe(self) -> str:
        if self.mode is PieceMode.PRIORITY:
            return f"priority mode: pieces of {self.target_ms:g} ms, at least one layer phase of one row"
        if self.mode is PieceMode.GATE:
            return "gate mode: micro-steps of whole rows, at least the step at one row"
        return "whole layer phases at the guest's batch"


def cluster_shares(*, dp_ms: float, iteration_ms: float, hosting_ms: float, gpus: int,
                   lent_usable: float) -> tuple[float, float]:
    """``(fg_share, bg_share)`` of a plan whose ranks holding background work have usable fractions summing
    to ``lent_usable`` (0: none lent, the plan runs alone): the cluster objective's ``J`` terms
    (:mod:`deeppool.planner.solve.throughput`), whatever supply fills the ranks.

        fg_share = T_dp / T_host,  T_host = hosting_ms if lent_usable > 0 else iteration_ms
        bg_share = lent_usable / G

    The planner counts every lendable rank (DeepPool's unlimited supply); a scheduling policy counts only
    the ranks the background jobs that exist fill (:mod:`deeppool.scheduling.demand`).
    """
    if iteration_ms <= 0:
        return 1.0, 0.0
    if lent_usable <= 0:
        return dp_ms / iteration_ms, 0.0
    return dp_ms / hosting_ms, lent_usable / gpus


def idle_throughout(windows_ms: tuple[float, ...], iteration_ms: float) -> bool:
    """Whether the windows are one whole iteration: the rank runs no layer of the plan."""
    return len(windows_ms) == 1 and windows_ms[0] >= iteration_ms * (1 - _WHOLE) > 0


def _fit(window_ms: float, piece_ms: float) -> float:
    """The part of a window that whole pieces of ``piece_ms`` fill."""
    if piece_ms <= 0:
        return window_ms
    return (window_ms // piece_ms) * piece_ms
