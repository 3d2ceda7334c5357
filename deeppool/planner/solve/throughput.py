"""The cluster's throughput under a plan, and the plan that maximises it exactly (``--objective cluster``).

**The objective.** A plan on ``G`` GPUs with iteration time ``T`` leaves every
rank ``r`` its idle windows ``len_w`` (:func:`deeppool.plans.plan.rank_idle_windows`;
a rank that runs no layer has one window, the whole iteration). Background
work fills them as the simulator's one interference model says
(:class:`deeppool.planner.profiling.interference.InterferenceModel`, read from
``--interference interference.json`` or its documented defaults; ``fit(len)`` is
``len`` in whole pieces of the background's ``bg_piece_ms``, all of ``len`` when 0 and on a
rank that runs no layer, whose window runs into the next iteration's with no foreground
work between them, so a piece may cross):

    usable_r = min(1, Σ_w e(len_w) · fit(len_w) / T)        (InterferenceModel.usable_fraction)
    lent     = {r : idle_r / T ≥ min_lend_fraction and usable_r > 0}
    fg_share = T_dp / (T · s),   s = fg_slowdown if lent ≠ ∅ else 1
    bg_share = Σ_{r ∈ lent} usable_r / G
    J        = fg_share + bg_share                           (data parallel on all G GPUs: J = 1)

``J`` is the cluster's throughput over data parallel on all GPUs, in the units
of DeepPool's evaluation and of ``deeppool simulate-deeppool``: a lent GPU-second
at efficiency ``e`` is ``e`` GPU-seconds of a background job's own one-GPU run.
Data parallel at width ``w < G`` is one plan among the rest (its ``G − w`` idle
ranks are windows one iteration long), so the optimum is never below right-sizing
at the model's efficiency.

**Exact search** (:func:`cluster_optimum`), over the same candidate counts as the
time objective. ``J`` is not linear (windows, thresholds, ``1/T``), but it is
bounded by what the ILP optimises exactly. With ``B'`` the GPU-time the ILP
prices (``Σ_l g_l·layer_ms_l(g_l) + Σ_g g·(ROUNDS(g) + SKEW(g))`` plus every edge's reshards,
``max(g_u, g_v)`` ranks for their round trip, priced exactly through one column per pair of counts,
:class:`deeppool.planner.solve.ilp.Ilp`'s ``reshard_pairs``: the plan's busy GPU-time ``B`` less only the
optimizer's per-call step, ``tests/planner/test_ilp.py``), ``ē`` the largest efficiency of any window and
``c = ē / G``:

* a plan that lends has ``usable_r ≤ ē · idle_r / T`` (``fit(len) ≤ len``) and ``Σ_r idle_r = G·T − B``, so
  ``J ≤ T_dp/(s·T) + ē·(1 − B/(G·T)) ≤ ē + (T_dp/s − c·B')/T =: U``;
* a plan that lends nothing has ``J = T_dp / T``.

Let ``λ`` be the best ``J`` among the plans costed so far (``λ ≥ 1``: data parallel
on all GPUs is costed first, and ``ē ≤ 1``). A lending plan can beat ``λ`` only if
``U > λ``, i.e. ``(λ − ē)·T + c·B' < T_dp/s``: the ILP minimises exactly that
(``T + price·B'`` with ``price = c/(λ − ē)``) over the plans not yet costed (no-good
cuts). If its minimum is ``≥ T_dp/s``, no uncosted lending plan beats ``λ``; else
its plan is costed, cut off, and the step repeats. A plan that lends nothing can
beat ``λ`` only if ``T < T_dp/λ``: the time ILP over the uncosted plans finds the
fastest; once it is ``≥ T_dp/λ`` none can. Both loops end (finitely many plans,
each costed once), and when both have stopped no uncosted plan beats the best
costed one: **the returned plan maximises J**. ``tests/planner/test_throughput.py``
checks it against enumerating every assignment.

The stopping test reads the ILP's own minimum (its objective, not the cost model's
``B'`` of the plan it returns), which lies below every uncosted plan's
``(λ − ē)·T + c·B``. A solve stopped at its time limit has only an incumbent, above the
minimum: the test then reads the solver's lower bound, ``objective·(1 − gap)``
(:attr:`deeppool.planner.solve.ilp.IlpResult.least`), so a search that stops early never states a
bound below a plan it did not cost.

With a tolerance ``ε`` (the planner's default, 0.2%) both tests use ``λ·(1 + ε)`` in
place of ``λ``: the plan returned is then proven within ``ε`` of the best. The
bound is loose where idle time cannot be lent (ranks idle for less than
``min_lend_fraction``, windows shorter than the efficiency curve's first bin) and by
pieces: ``fit(len)`` falls short of ``len`` by up to a piece in every window of a rank that runs
a layer, and a window shorter than a piece holds nothing. The second is learnt from the plans the search
costs: each short window of a costed plan adds rows (:mod:`deeppool.planner.solve.windows`) that price its idle
time as unusable in every plan that keeps it as short, so ``B'`` grows by it there and the bound stays a
bound. A search whose guests' pieces are long beside the windows may still end at the time limit, with
its bound open by those pieces (``docs/planner.md``). A rank that runs no layer loses nothing to pieces,
so the bound is exact there where the efficiency is flat. Reshards are priced at their exact GPU-time
(``docs/notes/0018-cluster-search-exact-reshards.md``). Each near-tie plan costs one ILP solve with cuts,
and ``ε`` ends most searches after one. The loops stop early only at the step cap or the time limit, and
the status then says how far the bound is open.

**Its solves.** Every solve of a search is one HiGHS model (:class:`deeppool.planner.solve.ilp.Ilp`, built once):
a step changes the price and which no-good cuts bind. Each solve carries the step's stopping threshold as a
cutoff, so branch and bound prunes every node whose bound reaches it, and "infeasible" is exactly the stop.
Neither changes what a step concludes, so the proof above holds as it stands
(``docs/notes/0100-one-ilp-model-per-search.md``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property

from deeppool.errors import DeeppoolError
from deeppool.planner.profiling.interference import InterferenceModel, cluster_shares
from deeppool.planner.solve.build import rank_idle_windows
from deeppool.planner.solve.candidates import useful_counts
from deeppool.planner.solve.cost import CostModel, SchedulePhase
from deeppool.planner.solve.ilp import Ilp, IlpResult, SolverName
from deeppool.planner.solve.windows import WindowCuts

MAX_STEPS = 30
"""Bounding steps (one or two ILP solves each) the exact search may take before it stops and says how far its
bound is open: the 60 solves of the search that always solved without cuts first."""
_TOLERANCE = 1e-9
_CUTOFF_SLACK = 1e-5
"""The ILP's cutoff sits this share above the search's threshold: the ILP's time and the cost model's agree
to rounding (``tests/planner/test_ilp.py``), so no plan under the threshold is pruned."""
DEFAULT_CLUSTER_GAP = 2e-3
"""``--cluster-gap``'s default: the cluster objective's plan is proven best to within 0.2% of the cluster's
throughput, below the cost model's precision; at 0 the search costs, one ILP solve each, the many plans that
differ from the best in one small layer by less than that."""
DEFAULT_TOLERANCE = DEFAULT_CLUSTER_GAP


@dataclass(frozen=True, kw_only=True)
class Shares:
    """One plan's cluster throughput over data parallel on all GPUs, and what makes it up."""

    fg_share: float
    bg_share: float
    lent_fraction: float
    """Idle rank-time on lent ranks over ``G · T``: what the plan offers background work."""

    @property
    def throughput(self) -> float:
        return self.fg_share + self.bg_share


def shares(
    cost: CostModel, assignment: Mapping[str, int], *, gpus: int, dp_ms: float, model: InterferenceModel
) -> Shares:
    """``J`` of ``assignment`` (the module's formula), from its schedule's idle windows."""
    phases = cost.schedule(assignment)
    iteration = cost.iteration_ms(assignment)
    if iteration <= 0:
        return Shares(fg_share=1.0, bg_share=0.0, lent_fraction=0.0)
    usable = lent_idle = 0.0
    for rank, count in _rank_groups(phases, gpus):
        windows = tuple(w.length_ms for w in rank_idle_windows(phases, rank, iteration))
        idle = sum(windows)
        fraction = model.usable_fraction(windows, iteration, piece_ms=model.bg_piece_ms)
        if idle / iteration >= model.min_lend_fraction and fraction > 0:
            usable += count * fraction
            lent_idle += count * idle
    fg_share, bg_share = cluster_shares(dp_ms=dp_ms, iteration_ms=iteration, hosting_ms=iteration * model.fg_slowdown,
                                        gpus=gpus, lent_usable=usable)
    return Shares(fg_share=fg_share, bg_share=bg_share, lent_fraction=lent_idle / (gpus * iteration))


def _rank_groups(phases: list[SchedulePhase], gpus: int) -> list[tuple[int, int]]:
    """(a representative rank, how many ranks share its windows): ranks between two phase widths run alike."""
    edges = sorted({0, gpus, *(min(p.ranks, gpus) for p in phases)})
    return [(low, high - low) for low, high in zip(edges, edges[1:], strict=False) if high > low]


def right_sizing(cost: CostModel, gpus: int, dp_ms: float) -> tuple[int, float]:
    """The strong baseline: data parallel at the width ``w`` maximising ``T_dp/T_w + (G − w)/G``, the
    GPUs it leaves doing background work at full efficiency (a Pollux-style scheduler's right-sizing)."""
    best = (gpus, 1.0)
    for width in useful_counts(gpus, cost.global_batch):
        iteration = cost.iteration_ms(dict.fromkeys(cost.graph.names, width))
        value = dp_ms / iteration + (gpus - width) / gpus if iteration > 0 else 0.0
        if value > best[1] + _TOLERANCE:
            best = (width, value)
    return best


@dataclass(frozen=True, kw_only=True)
class ClusterSearch:
    """What :func:`cluster_optimum` found, and whether it proved it best."""

    assignment: dict[str, int]
    shares: Shares
    costed: int
    solves: int
    proven: bool
    bound: float
    tolerance: float

    @property
    def status(self) -> str:
        head = f"cluster throughput {self.shares.throughput:.3f}x data parallel"
        if self.proven:
            within = f" within {self.tolerance:.1%}" if self.tolerance > 0 else ""
            return f"{head}, optimal{within} ({self.costed} plans costed, {self.solves} ILP solves)"
        if math.isinf(self.bound):
            return f"{head}, best of {self.costed} plans costed; not proven optimal (stopped before a bound)"
        return (f"{head}, best of {self.costed} plans costed; no plan exceeds {self.bound:.3f}x "
                f"(stopped after {self.solves} ILP solves)")


@dataclass(frozen=True, kw_only=True)
class ClusterProblem:
    """The planning problem the search solves: candidate counts, limits, solver and interference."""

    cost: CostModel
    options: dict[str, tuple[int, ...]]
    gpus: int
    dp_ms: float
    model: InterferenceModel
    memory_bytes: int | None
    time_limit_s: float
    solver: SolverName | None
    fastest_ms: float
    """The least iteration time over the options (the time optimum's): no plan is faster."""
    tolerance: float = DEFAULT_TOLERANCE
    """Stop once no uncosted plan can beat the best by more than this share (0: exactly the best)."""


def cluster_optimum(problem: ClusterProblem, seeds: list[dict[str, int]]) -> ClusterSearch:
    """The plan maximising ``J`` over ``problem.options`` (the module's proof); ``seeds`` are costed first
    (they must keep to the options and limits: data parallel at every width, the time optimum)."""
    search = _Search(problem)
    for seed in seeds:
        search.cost(seed)
    lending = fastest = True
    while lending or fastest:  # the lending loop to its end, then the fastest-plan loop to its end
        if search.steps >= MAX_STEPS or time.perf_counter() > search.deadline:
            return search.result(proven=False, fastest_open=fastest)
        if lending:
            lending = search.lending_step()
        else:
            fastest = search.fastest_step()
    return search.result(proven=not search.failed, fastest_open=False)


class _Search:
    """The costed plans, the best of them and the two bounding steps of the module's proof."""

    def __init__(self, problem: ClusterProblem) -> None:
        self.problem = problem
        self.costed: dict[tuple[int, ...], Shares] = {}
        self.best: tuple[dict[str, int], Shares] | None = None
        self.solves = 0
        self.steps = 0
        self.lending_bound = float("inf")
        self.failed = False
        self.deadline = time.perf_counter() + problem.time_limit_s
        self.uncut_price: float | None = None
        """The price of the last solve without cuts whose minimiser was already costed (None: none yet)."""

    @cached_property
    def ilp(self) -> Ilp:
        """One model for every solve of the search: each solve changes only the price and which cuts bind."""
        p = self.problem
        return Ilp(p.cost, p.options, memory_bytes=p.memory_bytes, solver=p.solver, reshard_pairs=True)

    @property
    def value(self) -> float:
        return self.best[1].throughput if self.best is not None else 1.0

    @property
    def target(self) -> float:
        """``λ·(1 + tolerance)``: what an uncosted plan must be able to beat to be costed."""
        return self.value * (1 + self.problem.tolerance)

    def cost(self, assignment: dict[str, int]) -> None:
        key = self._key(assignment)
        if key in self.costed:
            return
        found = shares(self.problem.cost, assignment, gpus=self.problem.gpus, dp_ms=self.problem.dp_ms,
                       model=self.problem.model)
        self.costed[key] = found
        if self.best is None or found.throughput > self.value + _TOLERANCE:
            self.best = (dict(assignment), found)
        if self.windows is not None:
            self.ilp.add_window_cuts(self.windows.of(assignment))

    @cached_property
    def windows(self) -> WindowCuts | None:
        """The short windows' cuts, with a guest's pieces (without, every idle millisecond may hold work)."""
        p = self.problem
        if p.model.bg_piece_ms <= 0:
            return None
        return WindowCuts(cost=p.cost, options=p.options, gpus=p.gpus, piece_ms=p.model.bg_piece_ms)

    def _excluded(self) -> tuple[dict[str, int], ...]:
        names = self.problem.cost.graph.names
        return tuple(dict(zip(names, key, strict=True)) for key in self.costed)

    def _solve(self, price: float, cutoff: float) -> IlpResult | None:
        """The ILP's minimiser over the uncosted plans: solved without cuts first (its LP relaxation stays
        integral, so this is fast), and with one no-good cut per costed plan only when that one is costed.

        The solve without cuts is skipped at the price of an earlier one whose minimiser was costed: the
        model is the same, so its minimum is the same and is reached only by costed plans or by plans no
        cheaper than them; the solve with cuts, which decides, is run either way.

        ``cutoff`` (in the ILP's objective, ``T + price·B'/1000``): the caller stops at any minimum at or
        above it, so branch and bound prunes there, and None (infeasible) means no uncosted plan is below
        it, which is what the caller's stopping test would have concluded from the minimum itself."""
        self.steps += 1
        cutoff *= 1 + _CUTOFF_SLACK
        if price != self.uncut_price:
            found = self._solve_once(price, (), cutoff)
            if found is None or self._key(found.assignment) not in self.costed:
                return found
            self.uncut_price = price
        return self._solve_once(price, self._excluded(), cutoff)

    def _solve_once(self, price: float, exclude: tuple[dict[str, int], ...], cutoff: float) -> IlpResult | None:
        self.solves += 1
        try:
            return self.ilp.solve(price=price, exclude=exclude, cutoff=cutoff,
                                  time_limit_s=max(1.0, self.deadline - time.perf_counter()))
        except DeeppoolError as err:
            if "(Infeasible)" not in str(err):  # a time-out: nothing is proven
                self.failed = True
            return None  # else every plan is costed (the cuts leave none)

    def _key(self, assignment: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(assignment[name] for name in self.problem.cost.graph.names)

    def lending_step(self) -> bool:
        """Cost the plan minimising ``(λ − ē)·T + c·B'`` if it may beat ``λ``; False once none can."""
        p, slowdown = self.problem, self.problem.model.fg_slowdown
        peak = p.model.max_efficiency
        if peak <= 0:
            return False
        unit = peak / p.gpus
        margin = max(self.target - peak, _TOLERANCE)
        found = self._solve(1e3 * unit / margin, cutoff=p.dp_ms / slowdown / margin)
        if found is None:
            return False
        least = margin * found.least  # the least (λ − ē)·T + c·B' over the uncosted plans (a bound if stopped early)
        if least >= (p.dp_ms / slowdown) * (1 - _TOLERANCE):
            return False
        # every uncosted lending plan a has U(a) ≤ target + (T_dp/s − least) / T_a, and T_a ≥ T_min; a later
        # step bounds fewer plans, so an earlier step's bound still holds (one cut short by the limit is weaker)
        step_bound = (self.target + (p.dp_ms / slowdown - least) / p.fastest_ms if p.fastest_ms > 0
                      else float("inf"))
        self.lending_bound = min(self.lending_bound, step_bound)
        self.cost(found.assignment)
        return True

    def fastest_step(self) -> bool:
        """Cost the fastest uncosted plan if it may beat ``λ`` lending nothing; False once none can.

        No plan is faster than the time optimum (a seed), so when ``T_dp / T_min ≤ λ`` nothing is solved."""
        limit = self.problem.dp_ms / self.target * (1 - _TOLERANCE)
        if self.problem.fastest_ms >= limit:
            return False
        found = self._solve(0.0, cutoff=limit)
        if found is None or found.least >= limit:
            return False  # no uncosted plan is faster than the limit (a solve stopped early: by its lower bound)
        if found.optimal and self.problem.cost.iteration_ms(found.assignment) >= limit:
            return False
        self.cost(found.assignment)
        return True

    def result(self, *, proven: bool, fastest_open: bool) -> ClusterSearch:
        """The best costed plan; unproven, with the bound on every uncosted plan: lending ones by the last
        lending step, the others by ``T_dp / T_min`` while the fastest loop is open."""
        assert self.best is not None, "the search costs its seeds first"
        assignment, found = self.best
        p = self.problem
        resting = (p.dp_ms / p.fastest_ms if p.fastest_ms > 0 else float("inf")) if fastest_open else 0.0
        bound = found.throughput if proven else max(self.lending_bound, resting, found.throughput)
        return ClusterSearch(assignment=assignment, shares=found, costed=len(self.costed), solves=self.solves,
                             proven=proven, bound=bound, tolerance=self.problem.tolerance)


def priced_gpu_ms(cost: CostModel, assignment: Mapping[str, int]) -> float:
    """The GPU-time (ms) the ILP's price multiplies without the reshard floor, ``Σ_l g_l·layer_ms_l(g_l) +
    Σ_g g·(ROUNDS(g) + SKEW(g))`` (``--objective time+gpu-time``; the cluster search's ``B'`` adds the floor)."""
    layers = sum(assignment[layer.name] * cost.layer_ms(layer, assignment[layer.name]) for layer in cost.graph.layers)
    return layers + sum(assignment[name] * ms for name, ms in cost.group_rounds_ms(assignment).items())
