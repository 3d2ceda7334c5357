"""The burst-parallel ILP (pulp): every layer picks one GPU count.

Variables: ``x[l,g] ∈ {0,1}``, layer ``l`` runs on ``g`` GPUs (one count per
layer). The reshard cost of an edge ``u→v`` each way, ``R(g_u, g_v) = [g_u ≠ g_v] ·
(max(σ(g_u), σ(g_v)) + [max(g_u, g_v) > node]·max(δ(g_u), δ(g_v)))`` (plus the
sending side's synchronisation latency) with ``σ``
the cost model's in-node side time and ``δ`` what crossing nodes adds (together
``σ_x(min(g_u, g_v))`` when the pair crosses nodes), is carried by small
min-cost flows per edge (*ladders*: one over the in-node counts with sides
``σ``, one over every count with sides ``σ_x``): the counts sorted by ``σ``
descending are levels ``1..K``; one unit of flow goes from ``u``'s count to
``v``'s, either straight (``stay_g``, free, only when the counts are equal) or
into the ladder at level ``i`` (cost ``σ_i``), down the ladder (free) or up it
(``σ_k − σ_{k+1}`` a rung) and out at level ``j``; the cheapest such path
costs exactly ``σ_min(i,j) = max(σ_i, σ_j)``; the synchronisation latency
of each direction (``ω_g = ω_w(g)·[g > 1]`` for the sending count ``g``) is paid
on entry and exit. Minimise the cost model's iteration time::

    Σ_l Σ_g x[l,g]·layer_ms_l(g)·(1 + price·g/1000)
      + Σ_e Σ_ladders [2·(Σ_k σ_k·enter_k + Σ_k (σ_k − σ_{k+1})·up_k) + Σ_k ω_k·(enter_k + leave_k)]
    s.t.  Σ_g x[l,g] = 1,   stay_g + Σ_ladders enter_g = x[u,g],   stay_g + Σ_ladders leave_g = x[v,g],
          flow conservation on every ladder level,
          Σ_l Σ_g x[l,g]·mem_l(g) ≤ device memory           (rank 0 runs every layer)
          x[l,g] = x[m,g]  for layers l, m sharing a parameter (tied embeddings):
                           one count, so the shared gradient is summed in one group

The flow is the exact transport cost between the two layers' choices, so the
LP relaxation is the local-polytope relaxation (integral on chains) with
O(K) variables per edge instead of K² pair variables; with the cross-node
ladder beside the in-node one it was still integral on most examples
(``benchmarks/planner.py``), and branch and bound covers the rest.
The cluster objective's search prices the reshards' GPU-time too, which a
ladder's sums over counts cannot carry: there each edge has one column per pair
of counts instead (``reshard_pairs``, the same local polytope, ``K²`` columns).
The amplification limit is hard: counts above it are not offered
(:mod:`deeppool.planner.solve.candidates`).

**Build and solve.** The model is built once as a sparse row-wise matrix
(:class:`_Matrix`: plain lists, no per-variable objects) whose objective is
split as ``time + price · gpu_time``. With ``highspy`` installed it is passed to
HiGHS in one call and kept: :class:`Ilp` re-solves it at another ``price`` by
changing the costs (the simplex warm-starts from the last basis) and turns
no-good cuts on and off by their row bounds, which is what the cluster
objective's exact search (:mod:`deeppool.planner.solve.throughput`) does dozens of
times. Without ``highspy`` the same matrix goes through pulp to CBC.
"""

from __future__ import annotations

import enum
import importlib.util
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING

from deeppool.errors import DeeppoolError
from deeppool.planner.solve.cost import CostModel
from deeppool.quiet import native_output_hidden

if TYPE_CHECKING:
    import pulp as pulp_types

    from deeppool.model.graph import Layer
    from deeppool.planner.solve.cost import ScheduleSlot
    from deeppool.planner.solve.windows import WindowCut

_INF = float("inf")


class SolverName(enum.Enum):
    CBC = "cbc"
    HIGHS = "highs"


def default_solver() -> SolverName:
    return SolverName.HIGHS if importlib.util.find_spec("highspy") is not None else SolverName.CBC


@dataclass(frozen=True, kw_only=True)
class IlpResult:
    assignment: dict[str, int]
    solver: SolverName
    status: str
    optimal: bool
    seconds: float
    gap: float
    objective: float = 0.0
    """The ILP's objective at ``assignment`` (``time + price · gpu_time``, the model's own terms)."""

    @property
    def least(self) -> float:
        """What the solve proved no assignment is below: the objective when optimal, else the solver's lower
        bound, ``objective · (1 − gap)`` (0 when the solver gave no gap: a solve stopped at its limit)."""
        return self.objective if self.optimal else self.objective * max(0.0, 1.0 - self.gap)


def solve(
    cost: CostModel,
    options: dict[str, tuple[int, ...]],
    *,
    memory_bytes: int | None,
    time_limit_s: float,
    solver: SolverName | None = None,
    price: float = 0.0,
    exclude: tuple[Mapping[str, int], ...] = (),
) -> IlpResult:
    """Solve the ILP for ``options`` (the allowed counts of each layer).

    The LP relaxation is solved first: when its optimum is integral (the ladder
    formulation makes that the rule on these graphs) it is an optimal solution
    of the ILP, with gap 0. Otherwise the ILP is solved by branch and bound.
    ``price`` > 0 adds ``price · g · layer_ms(g) / 1000`` per layer (DeepPool's
    trade-off of time against GPU-time). ``exclude`` rules out those assignments (one no-good cut each,
    ``Σ_l x[l, a_l] ≤ L − 1``), which :mod:`deeppool.planner.solve.throughput` uses to search past plans it has costed.
    """
    return Ilp(cost, options, memory_bytes=memory_bytes, solver=solver).solve(
        price=price, exclude=exclude, time_limit_s=time_limit_s)


class Ilp:
    """The ILP of ``options`` built once, solved at any ``price`` with any set of no-good cuts.

    ``reshard_pairs``: every edge's reshards are priced through one column per pair of counts
    (:func:`_pairs`), time and GPU-time exactly, so ``price · gpu_time`` is ``price`` times the plan's busy
    GPU-time less only the optimizer's per-call step (the cluster search's bound,
    :mod:`deeppool.planner.solve.throughput`). Off, the edge ladders carry the reshards' time alone and the price
    multiplies the layers' and rounds' GPU-time (DeepPool's trade-off, exact)."""

    def __init__(self, cost: CostModel, options: dict[str, tuple[int, ...]], *, memory_bytes: int | None,
                 solver: SolverName | None = None, reshard_pairs: bool = False) -> None:
        self.solver = solver or default_solver()
        self.matrix, self.columns = _formulate(cost, options, memory_bytes, reshard_pairs=reshard_pairs)
        """The binary column ``x[l, g]`` of each layer ``l`` at each count ``g``, by layer name and count."""
        self.names = tuple(layer.name for layer in cost.graph.layers)
        self.cuts: dict[tuple[int, ...], tuple[int, float]] = {}
        """Each no-good cut's row and right-hand side, by the assignment it excludes."""
        self.backend = _Highs(self.matrix) if self.solver is SolverName.HIGHS else _Cbc(self.matrix)
        self.windows: set[tuple[object, ...]] = set()
        self.unusable: dict[tuple[int, ScheduleSlot], int] = {}
        """The column of each rank group's idle time in a phase that no piece can use, by (group, slot)."""

    def add_window_cuts(self, cuts: Iterable[WindowCut]) -> int:
        """Price each short window's idle time at its ranks' GPU-time (:mod:`deeppool.planner.solve.windows`): one
        column ``β`` of the binaries that void the cut, and per phase ``v ≥ t_φ(x) − max_g ms_φ(g)·β``.
        Returns the rows added (a window already added adds none)."""
        added = 0
        for cut in cuts:
            key = (cut.low, cut.opening, tuple(slot for slot, _, _ in cut.idle))
            if key in self.windows:
                continue
            self.windows.add(key)
            opening = self._column(0.0)  # a count outside this model's options is never taken: it voids nothing
            self.backend.add_row([(opening, 1.0), *((self.columns[name][g], -1.0) for name, g in cut.opening
                                                    if g in self.columns[name])], 0.0, 0.0)
            for slot, times, most in cut.idle:
                if (cut.low, slot) not in self.unusable:
                    self.unusable[cut.low, slot] = self._column(cut.ranks / 1e3)
                terms = [(self.unusable[cut.low, slot], 1.0), (opening, most)]
                choices = self.columns[slot.layer]
                terms += [(choices[g], -ms) for g, ms in times if ms > 0 and g in choices]
                self.backend.add_row(terms, 0.0, _INF)
                added += 1
        return added

    def _column(self, gpu_cost: float) -> int:
        """A continuous column ``≥ 0`` added after the build, priced ``price · gpu_cost``."""
        j = self.matrix.column()
        self.matrix.gpu_cost[j] = gpu_cost
        self.backend.add_column()
        return j

    def solve(self, *, price: float = 0.0, exclude: Iterable[Mapping[str, int]] = (),
              time_limit_s: float, cutoff: float = _INF) -> IlpResult:
        """The cheapest assignment at ``price`` other than those of ``exclude`` (see :func:`solve`).

        ``cutoff``: only an objective below it is of use to the caller. Branch and bound (HiGHS) prunes
        every node whose bound reaches it (the LP relaxation's minimum too) and may then end on an
        incumbent above it, which is reported as infeasible: no assignment is below the cutoff. A solve that
        ends optimal returns the same minimum as without it.
        CBC ignores it and returns the minimum."""
        active = {self._cut(assignment) for assignment in exclude} - {None}
        self.backend.bound_rows({row: rhs if row in active else _INF for row, rhs in self.cuts.values()})
        started = time.perf_counter()
        costs = self.matrix.costs(price)
        outcome = self.backend.run(costs, self.matrix.binaries, time_limit_s, cutoff)
        seconds = time.perf_counter() - started
        values = outcome.values
        if values is None or not all(any(values[j] > 0.5 for j in choice.values()) for choice in self.columns.values()):
            raise DeeppoolError(
                f"the ILP found no plan ({outcome.status}) within {time_limit_s:g} s: "
                "raise --time-limit or relax --amplification"
            )
        assignment = {name: max(choice, key=lambda g: values[choice[g]]) for name, choice in self.columns.items()}
        return IlpResult(assignment=assignment, solver=self.solver, status=outcome.description,
                         optimal=outcome.optimal, seconds=seconds, gap=outcome.gap,
                         objective=sum(c * v for c, v in zip(costs, values, strict=True)))

    def _cut(self, assignment: Mapping[str, int]) -> int | None:
        """The row of the no-good cut ``Σ_l x[l, a_l] ≤ L − 1`` (added on first use); None outside the options."""
        key = tuple(assignment[name] for name in self.names)
        if key not in self.cuts:
            if any(g not in self.columns[name] for name, g in zip(self.names, key, strict=True)):
                return None
            terms = [(self.columns[name][g], 1.0) for name, g in zip(self.names, key, strict=True)]
            self.cuts[key] = (self.backend.add_row(terms, -_INF, len(terms) - 1.0), len(terms) - 1.0)
        return self.cuts[key][0]


@dataclass(kw_only=True)
class _Matrix:
    """The model as lists: per column its time and GPU-time cost and upper bound; rows in CSR form."""

    time_cost: list[float] = field(default_factory=list)
    gpu_cost: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    binaries: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=lambda: [0])
    index: list[int] = field(default_factory=list)
    value: list[float] = field(default_factory=list)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)

    def column(self, *, upper: float = _INF, binary: bool = False) -> int:
        self.time_cost.append(0.0)
        self.gpu_cost.append(0.0)
        self.upper.append(upper)
        if binary:
            self.binaries.append(len(self.upper) - 1)
        return len(self.upper) - 1

    def row(self, terms: Iterable[tuple[int, float]], lower: float, upper: float) -> int:
        for column, coefficient in terms:
            self.index.append(column)
            self.value.append(coefficient)
        self.starts.append(len(self.index))
        self.row_lower.append(lower)
        self.row_upper.append(upper)
        return len(self.row_lower) - 1

    def costs(self, price: float) -> list[float]:
        if price == 0:
            return list(self.time_cost)
        return [t + price * g for t, g in zip(self.time_cost, self.gpu_cost, strict=True)]


def _formulate(
    cost: CostModel, options: dict[str, tuple[int, ...]], memory_bytes: int | None, *, reshard_pairs: bool = False
) -> tuple[_Matrix, dict[str, dict[int, int]]]:
    m = _Matrix()
    x = {layer.name: {g: m.column(upper=1.0, binary=True) for g in options[layer.name]} for layer in cost.graph.layers}
    for layer in cost.graph.layers:
        m.row(((j, 1.0) for j in x[layer.name].values()), 1.0, 1.0)
        for g, j in x[layer.name].items():
            ms = cost.layer_ms(layer, g)
            m.time_cost[j] = ms
            m.gpu_cost[j] = ms * g / 1e3
    for src, dst in cost.graph.edges():
        _edge(m, cost, src, x[src], x[dst], pairs=reshard_pairs)
    for group in cost.graph.tied():
        _tie(m, [x[name] for name in group])
    _rounds(m, cost, x)
    _skews(m, cost, x)
    if memory_bytes is not None:
        usage = [(j, cost.memory_bytes(layer, g) / 2**20) for layer in cost.graph.layers
                 for g, j in x[layer.name].items()]
        m.row(usage, -_INF, memory_bytes / 2**20)
    return m, x


def _rounds(m: _Matrix, cost: CostModel, x: dict[str, dict[int, int]]) -> None:
    """Each rank group's all-reduce latency rounds, ``ROUNDS(g) = L(g)·max(1, (1 − ω)·S_g/b)`` when some
    layer with parameters runs on ``g > 1`` ranks: ``used_g ≥ x[l,g]`` for those layers, ``z_g ≥ used_g``,
    ``z_g ≥ (1 − ω)·Σ_l x[l,g]·W_l/b``, cost ``L(g)·z_g`` (the cost model's :meth:`CostModel.rounds_ms`)."""
    holders = [layer for layer in cost.graph.layers if cost.param_bytes(layer) > 0]
    share = 1 - cost.network.allreduce_overlap
    for g in sorted({g for layer in holders for g in x[layer.name] if g > 1}):
        latency = cost.round_ms(g)
        if latency <= 0:
            continue
        used = m.column(upper=1.0)
        rounds = m.column()
        members = [layer for layer in holders if g in x[layer.name]]
        for layer in members:
            m.row(((used, 1.0), (x[layer.name][g], -1.0)), 0.0, _INF)
        m.row(((rounds, 1.0), (used, -1.0)), 0.0, _INF)
        if share > 0:
            bytes_in = [(x[layer.name][g], -share * cost.param_bytes(layer) / cost.bucket_bytes) for layer in members]
            m.row([(rounds, 1.0), *bytes_in], 0.0, _INF)
        m.time_cost[rounds] = latency
        m.gpu_cost[rounds] = latency * g / 1e3


def _skews(m: _Matrix, cost: CostModel, x: dict[str, dict[int, int]]) -> None:
    """Each rank group's skew, ``SKEW(g) = κ(g)·max(0, C_g − c_probe)`` (:meth:`CostModel.skew_ms`): ``s_g ≥ 0``,
    ``s_g ≥ κ(g)·(Σ_l x[l,g]·c_l(g) − c_probe)`` with ``c_l`` the layer's compute, cost ``s_g``."""
    after = 1e3 * cost.network.skew_after_s
    for g in sorted({g for choice in x.values() for g in choice if g > 1}):
        slope = cost.network.skew_per_s(g)
        if slope <= 0:
            continue
        skew = m.column()
        terms = [(x[layer.name][g], -slope * sum(cost.compute_ms(layer, g))) for layer in cost.graph.layers
                 if g in x[layer.name]]
        m.row([(skew, 1.0), *terms], -slope * after, _INF)
        m.time_cost[skew] = 1.0
        m.gpu_cost[skew] = g / 1e3


def _tie(m: _Matrix, choices: list[dict[int, int]]) -> None:
    """The layers of ``choices`` pick the same count (a count one of them lacks is ruled out)."""
    common = set.intersection(*(set(choice) for choice in choices))
    first = choices[0]
    for k, choice in enumerate(choices):
        for g, j in choice.items():
            if g not in common:
                m.row(((j, 1.0),), 0.0, 0.0)
            elif k:
                m.row(((j, 1.0), (first[g], -1.0)), 0.0, 0.0)


def _edge(m: _Matrix, cost: CostModel, src: str, xu: dict[int, int], xv: dict[int, int], *, pairs: bool) -> None:
    """Add an edge's reshards and their costs (both directions): with ``pairs`` one column per pair of counts
    (:func:`_pairs`), else the ladders.

    The unit of flow from u's count to v's goes straight (equal counts, free)
    or through one ladder: the in-node ladder (only the counts within a node,
    sides ``σ``) or, when some count leaves the node, the cross-node ladder
    (every count, sides ``σ_x``). Either costs ``max`` of the two sides, so the
    cheapest route is exactly the cost model's ``R(g_u, g_v)``.
    """
    if len(xu) == 1 and xu.keys() == xv.keys():
        return
    producer = cost.graph.layer(src)
    if pairs:
        _pairs(m, cost, producer, xu, xv)
        return
    counts = sorted(set(xu) | set(xv))
    inside = [g for g in counts if g <= cost.network.gpus_per_node]
    sync = {g: cost.sync_ms(g) for g in counts}
    rails = []
    if len(inside) > 1:
        rails.append(_ladder(m, {g: cost.reshard_side_ms(producer, g) for g in inside}, sync))
    if len(inside) < len(counts):
        rails.append(_ladder(m, {g: cost.reshard_side_ms(producer, g, across=True) for g in counts}, sync))
    for g in counts:
        stay = m.column() if g in xu and g in xv else None
        for end, port in ((xu, 0), (xv, 1)):
            if g not in end:
                continue
            terms = [(end[g], -1.0)] + ([(stay, 1.0)] if stay is not None else [])
            terms += [(rail[port][g], 1.0) for rail in rails if g in rail[port]]
            m.row(terms, 0.0, 0.0)


def _pairs(m: _Matrix, cost: CostModel, producer: Layer, xu: dict[int, int], xv: dict[int, int]) -> None:
    """The edge's reshards through one column per pair of counts, ``y[a,b] ≥ 0`` with ``Σ_b y[a,b] = x[u,a]``
    and ``Σ_a y[a,b] = x[v,b]`` (the local polytope, integral on chains as the ladders are), each priced
    exactly: the round trip ``R(a,b) + R(b,a)`` in time and ``max(a,b)`` ranks held for it in GPU-time, as
    :meth:`CostModel.schedule` holds them. ``K_u·K_v`` columns, where the ladders have ``O(K)``: the price
    of an exact GPU-time, which the ladders' sums over counts cannot carry."""
    pairs = {(a, b): m.column() for a in xu for b in xv}
    for (a, b), j in pairs.items():
        ms = cost.round_trip_ms(producer, a, b)
        m.time_cost[j] = ms
        m.gpu_cost[j] = max(a, b) * ms / 1e3
    for a, j in xu.items():
        m.row([(j, -1.0), *((pairs[a, b], 1.0) for b in xv)], 0.0, 0.0)
    for b, j in xv.items():
        m.row([(j, -1.0), *((pairs[a, b], 1.0) for a in xu)], 0.0, 0.0)


def _ladder(m: _Matrix, side: dict[int, float], sync: dict[int, float]) -> tuple[dict[int, int], dict[int, int]]:
    """Levels sorted by side descending: enter at ``σ_i``, go down free, up at ``σ_k − σ_{k+1}``, leave free;
    entering from and leaving to count ``g`` adds ``sync[g]`` (the direction that count sends). Returns the
    entry and exit columns by count."""
    levels = sorted(side, key=lambda g: (-side[g], g))
    sides = [side[g] for g in levels]
    down = [m.column() for _ in range(len(levels) - 1)]
    up = [m.column() for _ in range(len(levels) - 1)]
    for k, j in enumerate(up):
        m.time_cost[j] = 2 * (sides[k] - sides[k + 1])
    enter: dict[int, int] = {}
    leave: dict[int, int] = {}
    for k, g in enumerate(levels):
        enter[g], leave[g] = m.column(), m.column()
        m.time_cost[enter[g]] = 2 * sides[k] + sync[g]
        m.time_cost[leave[g]] = sync[g]
        ladder = [(enter[g], 1.0), (leave[g], -1.0)]
        if k:
            ladder += [(down[k - 1], 1.0), (up[k - 1], -1.0)]
        if k < len(up):
            ladder += [(up[k], 1.0), (down[k], -1.0)]
        m.row(ladder, 0.0, 0.0)
    return enter, leave


@dataclass(frozen=True, kw_only=True)
class _Outcome:
    """One solve: the column values (None without a solution) and what the solver proved."""

    values: list[float] | None
    status: str
    description: str
    optimal: bool
    gap: float


_BELOW_CUTOFF = _Outcome(values=None, status="Infeasible", description="infeasible below the cutoff", optimal=False,
                         gap=1.0)
"""What a solve with a cutoff reports when no assignment lies below it."""


def _integral(values: list[float], binaries: list[int]) -> bool:
    return all(min(abs(values[j]), abs(1 - values[j])) < 1e-6 for j in binaries)


class _Highs:
    """The matrix in one HiGHS instance: the LP relaxation first (warm-started), branch and bound if fractional."""

    def __init__(self, matrix: _Matrix) -> None:
        import highspy
        import numpy as np

        self.highspy, self.np = highspy, np
        with native_output_hidden():  # HiGHS prints a banner whatever its options
            self.highs = highspy.Highs()
        self.highs.setOptionValue("output_flag", False)
        self.highs.setOptionValue("threads", 1)
        lp = highspy.HighsLp()
        lp.num_col_, lp.num_row_ = len(matrix.upper), len(matrix.row_lower)
        lp.col_cost_ = np.array(matrix.time_cost)
        lp.col_lower_ = np.zeros(lp.num_col_)
        lp.col_upper_ = np.array(matrix.upper)
        lp.row_lower_ = np.array(matrix.row_lower)
        lp.row_upper_ = np.array(matrix.row_upper)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = lp.num_col_, lp.num_row_
        lp.a_matrix_.start_ = np.array(matrix.starts, dtype=np.int32)
        lp.a_matrix_.index_ = np.array(matrix.index, dtype=np.int32)
        lp.a_matrix_.value_ = np.array(matrix.value)
        self.highs.passModel(lp)
        self.columns = lp.num_col_
        self.integer = False

    def add_column(self) -> None:
        """A continuous column ``≥ 0`` without entries, costed at the next solve."""
        self.highs.addCol(0.0, 0.0, _INF, 0, self.np.array([], dtype=self.np.int32), self.np.array([]))
        self.columns += 1

    def add_row(self, terms: list[tuple[int, float]], lower: float, upper: float) -> int:
        columns, coefficients = zip(*terms, strict=True)
        self.highs.addRow(lower, upper, len(columns), self.np.array(columns, dtype=self.np.int32),
                          self.np.array(coefficients))
        return self.highs.getNumRow() - 1

    def bound_rows(self, upper: dict[int, float]) -> None:
        """Set these rows' upper bounds (no lower bound)."""
        for row, bound in upper.items():
            self.highs.changeRowBounds(row, -_INF, bound)

    def run(self, costs: list[float], binaries: list[int], time_limit_s: float, cutoff: float) -> _Outcome:
        np, highs, started = self.np, self.highs, time.perf_counter()
        highs.changeColsCost(self.columns, np.arange(self.columns, dtype=np.int32), np.array(costs))
        self._integer(binaries, False)
        highs.setOptionValue("presolve", "off")
        highs.setOptionValue("time_limit", float(time_limit_s))
        highs.run()
        optimal_lp = highs.getModelStatus() == self.highspy.HighsModelStatus.kOptimal
        values = list(highs.getSolution().col_value) if optimal_lp else None
        if values is not None and highs.getInfo().objective_function_value >= cutoff:  # a lower bound of all
            return _BELOW_CUTOFF
        if values is not None and _integral(values, binaries):
            return _Outcome(values=values, status="Optimal", description="optimal (integral LP relaxation)",
                            optimal=True, gap=0.0)
        self._integer(binaries, True)
        highs.setOptionValue("presolve", "choose")
        highs.setOptionValue("time_limit", max(time_limit_s - (time.perf_counter() - started), 1.0))
        highs.setOptionValue("objective_bound", float(cutoff))
        highs.run()
        highs.setOptionValue("objective_bound", _INF)
        outcome = self._mip_outcome()
        if outcome.optimal and highs.getInfo().objective_function_value >= cutoff:  # pruned down to one above it
            return _BELOW_CUTOFF
        return outcome

    def _mip_outcome(self) -> _Outcome:
        status, info = self.highs.getModelStatus(), self.highs.getInfo()
        statuses = self.highspy.HighsModelStatus
        found = info.primal_solution_status == 2  # kSolutionStatusFeasible
        values = list(self.highs.getSolution().col_value) if found else None
        if status == statuses.kOptimal:
            return _Outcome(values=values, status="Optimal", description="optimal", optimal=True,
                            gap=max(0.0, float(info.mip_gap)))
        if status in (statuses.kInfeasible, statuses.kUnboundedOrInfeasible):
            return _Outcome(values=None, status="Infeasible", description="infeasible", optimal=False, gap=1.0)
        described = "solution found" if found else "no solution found"
        return _Outcome(values=values, status="Not Solved", description=f"{described} (time limit)",
                        optimal=False, gap=max(0.0, float(info.mip_gap)) if found else 1.0)

    def _integer(self, binaries: list[int], integer: bool) -> None:
        if integer == self.integer:
            return
        kind = self.highspy.HighsVarType.kInteger if integer else self.highspy.HighsVarType.kContinuous
        self.highs.changeColsIntegrality(len(binaries), self.np.array(binaries, dtype=self.np.int32),
                                         self.np.array([kind] * len(binaries), dtype=self.np.uint8))
        self.integer = integer


class _Cbc:
    """The matrix through pulp to CBC, rebuilt each solve: the LP relaxation first, branch and bound if fractional."""

    def __init__(self, matrix: _Matrix) -> None:
        self.matrix = matrix

    def add_column(self) -> None:
        """The matrix holds the column already: the problem is rebuilt from it at each solve."""

    def add_row(self, terms: list[tuple[int, float]], lower: float, upper: float) -> int:
        return self.matrix.row(terms, lower, upper)

    def bound_rows(self, upper: dict[int, float]) -> None:
        for row, bound in upper.items():
            self.matrix.row_upper[row] = bound

    def run(self, costs: list[float], binaries: list[int], time_limit_s: float, cutoff: float) -> _Outcome:
        """``cutoff`` is not passed on: CBC solves to the minimum, which the caller compares with its cutoff."""
        import pulp

        problem, columns = self._problem(pulp, costs, set(binaries))
        started = time.perf_counter()
        problem.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, mip=False))
        values = [var.varValue or 0.0 for var in columns]
        if problem.status == pulp.LpStatusOptimal and _integral(values, binaries):
            return _Outcome(values=values, status="Optimal", description="optimal (integral LP relaxation)",
                            optimal=True, gap=0.0)
        remaining = max(time_limit_s - (time.perf_counter() - started), 1.0)
        problem.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=remaining, mip=True))
        optimal = problem.sol_status == pulp.LpSolutionOptimal
        found = problem.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)
        description = "optimal" if optimal else f"{pulp.LpSolution[problem.sol_status].lower()} (time limit)"
        return _Outcome(values=[var.varValue or 0.0 for var in columns] if found else None,
                        status=pulp.LpStatus[problem.status], description=description, optimal=optimal,
                        gap=0.0 if optimal else 1.0)

    def _problem(self, pulp: ModuleType, costs: list[float], binaries: set[int]
                 ) -> tuple[pulp_types.LpProblem, list[pulp_types.LpVariable]]:
        m = self.matrix
        problem = pulp.LpProblem("burst_parallel_plan", pulp.LpMinimize)
        columns = [problem.add_variable(f"c{j}", lowBound=0, upBound=None if upper == _INF else upper,
                                        cat=pulp.LpBinary if j in binaries else pulp.LpContinuous)
                   for j, upper in enumerate(m.upper)]
        problem.setObjective(pulp.LpAffineExpression([(columns[j], c) for j, c in enumerate(costs) if c]))
        for r, (lower, upper) in enumerate(zip(m.row_lower, m.row_upper, strict=True)):
            expression = pulp.LpAffineExpression(
                [(columns[m.index[k]], m.value[k]) for k in range(m.starts[r], m.starts[r + 1])])
            if lower == upper:
                problem.addConstraint(pulp.LpConstraint(expression, pulp.LpConstraintEQ, f"r{r}", lower))
            if lower != upper and lower > -_INF:
                problem.addConstraint(pulp.LpConstraint(expression, pulp.LpConstraintGE, f"r{r}", lower))
            if lower != upper and upper < _INF:
                problem.addConstraint(pulp.LpConstraint(expression, pulp.LpConstraintLE, f"r{r}", upper))
        return problem, columns
