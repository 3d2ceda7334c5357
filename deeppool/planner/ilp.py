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
The amplification limit is hard: counts above it are not offered
(:mod:`deeppool.planner.candidates`).

**Build and solve.** The model is built once as a sparse row-wise matrix
(:class:`_Matrix`: plain lists, no per-variable objects) whose objective is
split as ``time + price · gpu_time``. With ``highspy`` installed it is passed to
HiGHS in one call and kept: :class:`Ilp` re-solves it at another ``price`` by
changing the costs (the simplex warm-starts from the last basis) and turns
no-good cuts on and off by their row bounds, which is what the cluster
objective's exact search (:mod:`deeppool.planner.throughput`) does dozens of
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
from deeppool.quiet import native_output_hidden
from deeppool.planner.cost import CostModel
from deeppool.planner.graph import Layer

if TYPE_CHECKING:
    import pulp as pulp_types

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
    objective: float
    """The ILP's objective at the assignment, ``Σ time + price · Σ GPU-time`` as formulated (ms)."""


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
    ``Σ_l x[l, a_l] ≤ L − 1``), which :mod:`deeppool.planner.throughput` uses to search past plans it has costed.
    """
    result = Ilp(cost, options, memory_bytes=memory_bytes, solver=solver).solve(
        price=price, exclude=exclude, time_limit_s=time_limit_s)
    assert result is not None, "only a cutoff returns no result"
    return result


class Ilp:
    """The ILP of ``options`` built once, solved at any ``price`` with any set of no-good cuts."""

    def __init__(self, cost: CostModel, options: dict[str, tuple[int, ...]], *, memory_bytes: int | None,
                 solver: SolverName | None = None, busy_floor: bool = False) -> None:
        """``busy_floor`` adds to the priced GPU-time a floor of what the plan's busy GPU-time adds to it
        (:func:`_busy_floor`): the cluster objective's bound, never the time objectives'."""
        self.solver = solver or default_solver()
        self.matrix, self.x = _formulate(cost, options, memory_bytes)
        if busy_floor:
            _busy_floor(self.matrix, cost, self.x)
        self.names = tuple(layer.name for layer in cost.graph.layers)
        self.call_ms = cost.step_call_ms
        self.families: dict[tuple[int, float], tuple[tuple[int, float], ...]] = {}
        """The rows and right-hand sides of each ``(above, θ)`` restriction of :meth:`solve`, added on first use."""
        self.cuts: dict[tuple[int, ...], tuple[int, float]] = {}
        """Each no-good cut's row and right-hand side, by the assignment it excludes."""
        self.backend = _Highs(self.matrix) if self.solver is SolverName.HIGHS else _Cbc(self.matrix)

    def solve(self, *, price: float = 0.0, exclude: Iterable[Mapping[str, int]] = (), time_limit_s: float,
              above: int = 0, short_below: float | None = None, cutoff: float | None = None) -> IlpResult | None:
        """The cheapest assignment at ``price`` other than those of ``exclude`` (see :func:`solve`).

        ``above`` prices only the GPU-time of ranks ``above`` and up (``(g − above)⁺`` ranks of a layer on
        ``g``). ``short_below`` θ, with ``above`` > 0, keeps only the plans that may have ``above`` as their
        lowest rank idle for at least θ of the iteration (:meth:`_family`). With ``cutoff``, None when no
        assignment's objective is below it (HiGHS proves it from the LP relaxation or in branch and bound)."""
        active = {self._cut(assignment) for assignment in exclude} - {None}
        bounds = {row: rhs if row in active else _INF for row, rhs in self.cuts.values()}
        for key, rows in self.families.items():
            bounds.update((row, _INF) for row, _ in rows)
        if short_below is not None and above > 0:
            bounds.update(self._family(above, short_below))
        self.backend.bound_rows(bounds)
        costs = self.matrix.costs(price, above)
        started = time.perf_counter()
        outcome = self.backend.run(costs, self.matrix.binaries, time_limit_s, cutoff)
        if outcome.status == _CUTOFF:
            return None
        seconds = time.perf_counter() - started
        values = outcome.values
        if values is None or not all(any(values[j] > 0.5 for j in choice.values()) for choice in self.x.values()):
            raise DeeppoolError(
                f"the ILP found no plan ({outcome.status}) within {time_limit_s:g} s: "
                "raise --time-limit or relax --amplification"
            )
        assignment = {name: max(choice, key=lambda g: values[choice[g]]) for name, choice in self.x.items()}
        objective = sum(c * v for c, v in zip(costs, values, strict=True))
        return IlpResult(assignment=assignment, solver=self.solver, status=outcome.description,
                         optimal=outcome.optimal, seconds=seconds, gap=outcome.gap, objective=objective)

    def _family(self, above: int, share: float) -> tuple[tuple[int, float], ...]:
        """Rows (upper bounds) true of every plan whose lowest rank idle for ``θ·T`` or more is ``R = above``:

        * rank ``R − 1`` idles less than θ·T, and it idles at least while the layers on fewer than ``R`` ranks
          run (with their latency rounds): ``Σ_{g < R} time ≤ θ·T``;
        * rank ``R`` idles θ·T or more, at most while no layer on more than ``R`` ranks runs and no reshard
          holds more than ``R``: ``Σ_{g > R} time + Σ_ports [g > R]·(s̃(g) + ω_g)·port ≤ (1 − θ)·T`` (a reshard
          between ``g_u`` and ``g_v`` takes at least ``Σ_{ends} [g > R]·(s̃(g) + ω_g)`` while it holds more than
          ``R`` ranks: ``m.ports``);
        * the two ranks differ, so some phase, hence some layer, holds exactly ``R`` ranks: ``Σ_l x[l,R] ≥ 1``.

        ``T`` is every column's time plus ``OPT_call`` (a constant)."""
        key = (above, share)
        if key not in self.families:
            m = self.matrix
            ranks = {j: g for j, g, _ in m.busy}
            fewer = [(j, (ranks.get(j, above) < above) * t - share * t) for j, t in enumerate(m.time_cost) if t]
            held = dict.fromkeys(range(len(m.time_cost)), 0.0)
            for j, g, ms in m.ports:
                held[j] += (g > above) * ms
            more = [(j, (ranks.get(j, above) > above) * t + held[j] - (1 - share) * t)
                    for j, t in enumerate(m.time_cost) if t or held[j]]
            exact = [(choice[above], -1.0) for choice in self.x.values() if above in choice]
            rows = [(fewer, share * self.call_ms), (more, (1 - share) * self.call_ms)]
            rows += [(exact, -1.0)] if exact else [([(0, 0.0)], -1.0)]  # no layer offers R: the family is empty
            self.families[key] = tuple((self.backend.add_row(terms, -_INF, _INF), rhs) for terms, rhs in rows)
        return self.families[key]

    def _cut(self, assignment: Mapping[str, int]) -> int | None:
        """The row of the no-good cut ``Σ_l x[l, a_l] ≤ L − 1`` (added on first use); None outside the options."""
        key = tuple(assignment[name] for name in self.names)
        if key not in self.cuts:
            if any(g not in self.x[name] for name, g in zip(self.names, key, strict=True)):
                return None
            terms = [(self.x[name][g], 1.0) for name, g in zip(self.names, key, strict=True)]
            self.cuts[key] = (self.backend.add_row(terms, -_INF, len(terms) - 1.0), len(terms) - 1.0)
        return self.cuts[key][0]


@dataclass(kw_only=True)
class _Matrix:
    """The model as lists: per column its time and GPU-time cost and upper bound; rows in CSR form."""

    time_cost: list[float] = field(default_factory=list)
    busy: list[tuple[int, int, float]] = field(default_factory=list)
    """(column, ranks, ms): the column holds ``ranks`` ranks for ``ms`` (its GPU-time, priced)."""
    floors: list[_Floor] = field(default_factory=list)
    ports: list[tuple[int, int, float]] = field(default_factory=list)
    """(column, count, ms): a reshard ladder's entry or exit at that count, and a floor of the time the reshard
    through it holds that many ranks or more (:meth:`Ilp._family`)."""
    upper: list[float] = field(default_factory=list)
    binaries: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=lambda: [0])
    index: list[int] = field(default_factory=list)
    value: list[float] = field(default_factory=list)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)

    def column(self, *, upper: float = _INF, binary: bool = False) -> int:
        self.time_cost.append(0.0)
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

    def costs(self, price: float, above: int = 0) -> list[float]:
        """``time + price · GPU-time / 1000`` per column, GPU-time counted on ranks ``above`` and up."""
        costs = list(self.time_cost)
        if price == 0:
            return costs
        for j, ranks, ms in self.busy:
            costs[j] += price * max(0, ranks - above) * ms / 1e3
        for floor in self.floors:
            floor.price(costs, price, above)
        return costs


@dataclass(frozen=True, kw_only=True)
class _Floor:
    """A reshard floor ladder (:func:`_busy_floor`): its levels' counts, sides ``s̃`` and syncs, and columns."""

    rungs: _Rungs
    side: dict[int, float]
    sync: dict[int, float]

    def price(self, costs: list[float], price: float, above: int) -> None:
        """Add ``price ·`` the ladder of sides ``a_g = (g − above)⁺·s̃(g)`` (made non-increasing down the levels
        by a running minimum, so the route still costs no more than ``max`` of its ends) and ports
        ``(g − above)⁺·ω_g``, in GPU-ms / 1000."""
        rungs, sides, running = self.rungs, [], _INF
        for g in rungs.levels:
            running = min(running, max(0, g - above) * self.side[g] / 1e3)
            sides.append(running)
        for k, j in enumerate(rungs.up):
            costs[j] += price * 2 * (sides[k] - sides[k + 1])
        for k, g in enumerate(rungs.levels):
            port = price * max(0, g - above) * self.sync[g] / 1e3
            costs[rungs.enter[g]] += price * 2 * sides[k] + port
            costs[rungs.leave[g]] += port


def _formulate(
    cost: CostModel, options: dict[str, tuple[int, ...]], memory_bytes: int | None
) -> tuple[_Matrix, dict[str, dict[int, int]]]:
    m = _Matrix()
    x = {layer.name: {g: m.column(upper=1.0, binary=True) for g in options[layer.name]} for layer in cost.graph.layers}
    for layer in cost.graph.layers:
        m.row(((j, 1.0) for j in x[layer.name].values()), 1.0, 1.0)
        for g, j in x[layer.name].items():
            m.time_cost[j] = cost.layer_ms(layer, g)
            m.busy.append((j, g, m.time_cost[j]))
    for src, dst in cost.graph.edges():
        _edge(m, cost, src, x[src], x[dst])
    for group in cost.graph.tied():
        _tie(m, [x[name] for name in group])
    _rounds(m, cost, x)
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
        m.busy.append((rounds, g, latency))


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


def _edge(m: _Matrix, cost: CostModel, src: str, xu: dict[int, int], xv: dict[int, int]) -> None:
    """Add an edge's ladders and their costs (both directions).

    The unit of flow from u's count to v's goes straight (equal counts, free)
    or through one ladder: the in-node ladder (only the counts within a node,
    sides ``σ``) or, when some count leaves the node, the cross-node ladder
    (every count, sides ``σ_x``). Either costs ``max`` of the two sides, so the
    cheapest route is exactly the cost model's ``R(g_u, g_v)``.
    """
    if len(xu) == 1 and xu.keys() == xv.keys():
        return
    producer = cost.graph.layer(src)
    counts = sorted(set(xu) | set(xv))
    inside = [g for g in counts if g <= cost.network.gpus_per_node]
    sync = {g: cost.sync_ms(g) for g in counts}
    floor = _side_floor(cost, producer, counts)
    rails: list[tuple[dict[int, int], dict[int, int]]] = []
    if len(inside) > 1:
        rails.append(_ladder(m, {g: cost.reshard_side_ms(producer, g) for g in inside}, sync).ports)
    if len(inside) < len(counts):
        rails.append(_ladder(m, {g: cost.reshard_side_ms(producer, g, across=True) for g in counts}, sync).ports)
    for enter, leave in rails:
        m.ports += [(j, g, floor[g] + sync[g]) for g, j in (*enter.items(), *leave.items())]
    _ports(m, counts, xu, xv, rails)


def _side_floor(cost: CostModel, producer: Layer, counts: list[int]) -> dict[int, float]:
    """``s̃(g) = min_{h ≤ g} s(h)`` over ``counts`` (ascending), ``s`` the cheaper rail's side at a count: a
    reshard between counts ``g_u``, ``g_v`` has ``side(min(g_u, g_v)) ≥ max(s̃(g_u), s̃(g_v))``."""
    floor, running = {}, _INF
    for g in counts:
        inside = cost.reshard_side_ms(producer, g) if g <= cost.network.gpus_per_node else _INF
        running = min(running, inside, cost.reshard_side_ms(producer, g, across=True))
        floor[g] = running
    return floor


def _ports(m: _Matrix, counts: list[int], xu: dict[int, int], xv: dict[int, int],
           rails: list[tuple[dict[int, int], dict[int, int]]]) -> None:
    """One unit of flow from u's count to v's: straight when they are equal, else through one of ``rails``."""
    for g in counts:
        stay = m.column() if g in xu and g in xv else None
        for end, port in ((xu, 0), (xv, 1)):
            if g not in end:
                continue
            terms = [(end[g], -1.0)] + ([(stay, 1.0)] if stay is not None else [])
            terms += [(rail[port][g], 1.0) for rail in rails if g in rail[port]]
            m.row(terms, 0.0, 0.0)


def _busy_floor(m: _Matrix, cost: CostModel, x: dict[str, dict[int, int]]) -> None:
    """Price a floor of the busy GPU-time the ILP's GPU-time leaves out (GPU-ms / 1000, like the rest).

    * Reshards: an edge ``u→v`` holds ``max(g_u, g_v)`` ranks for ``R(g_u→g_v) + R(g_v→g_u)``, i.e.
      ``max(g_u, g_v)·(2·side(min(g_u, g_v)) + ω_{g_u} + ω_{g_v})`` when the counts differ. With
      ``s(g)`` the cheaper rail's side at ``g`` and ``s̃(g) = min_{h ≤ g} s(h)`` (over the edge's counts),
      ``max(g_u, g_v)·side(min) ≥ max(g_u·s̃(g_u), g_v·s̃(g_v))``: a ladder of sides ``a_g = g·s̃(g)``
      (its own unit of flow from u's count to v's), with ``g·ω_g`` on entry and exit. Priced from rank
      ``R`` up, ``g`` becomes ``(g − R)⁺`` (:class:`_Floor`).
    """
    for src, dst in cost.graph.edges():
        xu, xv = x[src], x[dst]
        if len(xu) == 1 and xu.keys() == xv.keys():
            continue
        producer = cost.graph.layer(src)
        counts = sorted(set(xu) | set(xv))
        side = _side_floor(cost, producer, counts)
        sync = {g: cost.sync_ms(g) for g in counts}
        rungs = _ladder(m, {g: g * side[g] for g in counts}, sync, timed=False)
        m.floors.append(_Floor(rungs=rungs, side=side, sync=sync))
        _ports(m, counts, xu, xv, [rungs.ports])


def _ladder(m: _Matrix, side: dict[int, float], sync: dict[int, float], *, timed: bool = True) -> _Rungs:
    """Levels sorted by side descending: enter at ``σ_i``, go down free, up at ``σ_k − σ_{k+1}``, leave free;
    entering from and leaving to count ``g`` adds ``sync[g]`` (the direction that count sends). These are its
    time costs; with ``timed`` False it has none (its costs are set per solve, :class:`_Floor`)."""
    costs: list[float] | dict[int, float] = m.time_cost if timed else {}
    levels = sorted(side, key=lambda g: (-side[g], g))
    sides = [side[g] for g in levels]
    down = [m.column() for _ in range(len(levels) - 1)]
    up = [m.column() for _ in range(len(levels) - 1)]
    for k, j in enumerate(up):
        costs[j] = 2 * (sides[k] - sides[k + 1])
    enter: dict[int, int] = {}
    leave: dict[int, int] = {}
    for k, g in enumerate(levels):
        enter[g], leave[g] = m.column(), m.column()
        costs[enter[g]] = 2 * sides[k] + sync[g]
        costs[leave[g]] = sync[g]
        ladder = [(enter[g], 1.0), (leave[g], -1.0)]
        if k:
            ladder += [(down[k - 1], 1.0), (up[k - 1], -1.0)]
        if k < len(up):
            ladder += [(up[k], 1.0), (down[k], -1.0)]
        m.row(ladder, 0.0, 0.0)
    return _Rungs(levels=tuple(levels), enter=enter, leave=leave, up=tuple(up))


@dataclass(frozen=True, kw_only=True)
class _Rungs:
    """A ladder's levels (counts, top first) and its entry, exit and up columns."""

    levels: tuple[int, ...]
    enter: dict[int, int]
    leave: dict[int, int]
    up: tuple[int, ...]

    @property
    def ports(self) -> tuple[dict[int, int], dict[int, int]]:
        return self.enter, self.leave


_CUTOFF = "Cutoff"


@dataclass(frozen=True, kw_only=True)
class _Outcome:
    """One solve: the column values (None without a solution) and what the solver proved."""

    values: list[float] | None
    status: str
    description: str
    optimal: bool
    gap: float


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

    def add_row(self, terms: list[tuple[int, float]], lower: float, upper: float) -> int:
        columns, coefficients = zip(*terms, strict=True)
        self.highs.addRow(lower, upper, len(columns), self.np.array(columns, dtype=self.np.int32),
                          self.np.array(coefficients))
        return self.highs.getNumRow() - 1

    def bound_rows(self, upper: dict[int, float]) -> None:
        """Set these rows' upper bounds (no lower bound)."""
        for row, bound in upper.items():
            self.highs.changeRowBounds(row, -_INF, bound)

    def run(self, costs: list[float], binaries: list[int], time_limit_s: float, cutoff: float | None) -> _Outcome:
        np, highs, started = self.np, self.highs, time.perf_counter()
        highs.changeColsCost(self.columns, np.arange(self.columns, dtype=np.int32), np.array(costs))
        self._integer(binaries, False)
        highs.setOptionValue("presolve", "off")
        highs.setOptionValue("time_limit", float(time_limit_s))
        highs.run()
        optimal_lp = highs.getModelStatus() == self.highspy.HighsModelStatus.kOptimal
        values = list(highs.getSolution().col_value) if optimal_lp else None
        if optimal_lp and cutoff is not None and highs.getInfo().objective_function_value >= cutoff:
            return _Outcome(values=None, status=_CUTOFF, description="cut off", optimal=True, gap=0.0)
        if values is not None and _integral(values, binaries):
            return _Outcome(values=values, status="Optimal", description="optimal (integral LP relaxation)",
                            optimal=True, gap=0.0)
        self._integer(binaries, True)
        highs.setOptionValue("presolve", "choose")
        highs.setOptionValue("time_limit", max(time_limit_s - (time.perf_counter() - started), 1.0))
        highs.setOptionValue("objective_bound", _INF if cutoff is None else cutoff)
        highs.run()
        outcome = self._mip_outcome()
        if cutoff is not None and outcome.values is None and outcome.status != "Not Solved":
            return _Outcome(values=None, status=_CUTOFF, description="cut off", optimal=True, gap=0.0)
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

    def add_row(self, terms: list[tuple[int, float]], lower: float, upper: float) -> int:
        return self.matrix.row(terms, lower, upper)

    def bound_rows(self, upper: dict[int, float]) -> None:
        for row, bound in upper.items():
            self.matrix.row_upper[row] = bound

    def run(self, costs: list[float], binaries: list[int], time_limit_s: float, cutoff: float | None) -> _Outcome:
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
