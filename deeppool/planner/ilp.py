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
ladder beside the in-node one it was still integral on every example
(``benchmarks/planner.py``), and branch and bound covers the rest.
The amplification limit is hard: counts above it are not offered
(:mod:`deeppool.planner.candidates`). CBC solves by default; HiGHS when
``highspy`` is installed.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass

import pulp

from deeppool.errors import DeeppoolError
from deeppool.quiet import native_output_hidden
from deeppool.planner.cost import CostModel


class SolverName(enum.Enum):
    CBC = "cbc"
    HIGHS = "highs"


def default_solver() -> SolverName:
    return SolverName.HIGHS if pulp.HiGHS().available() else SolverName.CBC


@dataclass(frozen=True, kw_only=True)
class IlpResult:
    assignment: dict[str, int]
    solver: SolverName
    status: str
    optimal: bool
    seconds: float
    gap: float


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
    chosen = solver or default_solver()
    problem, x = _formulate(cost, options, memory_bytes, price)
    for index, assignment in enumerate(exclude):
        cut = {x[name][g]: 1.0 for name, g in assignment.items() if g in x[name]}
        if len(cut) == len(x):
            _constrain(problem, cut, pulp.LpConstraintLE, len(x) - 1.0, f"seen_{index}")
    started = time.perf_counter()
    with native_output_hidden():  # HiGHS prints a banner whatever its options
        problem.solve(_backend(chosen, time_limit_s, mip=False))
        relaxed_ok = problem.status == pulp.LpStatusOptimal and _integral(x)
        if not relaxed_ok:
            remaining = max(time_limit_s - (time.perf_counter() - started), 1.0)
            problem.solve(_backend(chosen, remaining, mip=True))
    seconds = time.perf_counter() - started
    if not _has_solution(x):
        raise DeeppoolError(
            f"the ILP found no plan ({pulp.LpStatus[problem.status]}) within {time_limit_s:g} s: "
            "raise --time-limit or relax --amplification"
        )
    assignment = {
        name: max(choice, key=lambda g: choice[g].varValue or 0.0) for name, choice in x.items()
    }
    return IlpResult(
        assignment=assignment,
        solver=chosen,
        status=_status(problem, relaxed_ok),
        optimal=relaxed_ok or problem.sol_status == pulp.LpSolutionOptimal,
        seconds=seconds,
        gap=0.0 if relaxed_ok else _gap(problem, chosen),
    )


def _formulate(
    cost: CostModel, options: dict[str, tuple[int, ...]], memory_bytes: int | None, price: float
) -> tuple[pulp.LpProblem, dict[str, dict[int, pulp.LpVariable]]]:
    problem = pulp.LpProblem("burst_parallel_plan", pulp.LpMinimize)
    x = {
        layer.name: {g: problem.add_variable(f"x_{i}_{g}", cat=pulp.LpBinary) for g in options[layer.name]}
        for i, layer in enumerate(cost.graph.layers)
    }
    objective: dict[pulp.LpVariable, float] = {}
    for i, layer in enumerate(cost.graph.layers):
        _constrain(problem, {var: 1.0 for var in x[layer.name].values()}, pulp.LpConstraintEQ, 1.0, f"one_{i}")
        objective.update({var: cost.layer_ms(layer, g) * (1 + price * g / 1e3) for g, var in x[layer.name].items()})
    for index, (src, dst) in enumerate(cost.graph.edges()):
        objective.update(_edge(problem, cost, index, src, x[src], x[dst]))
    for index, group in enumerate(cost.graph.tied()):
        _tie(problem, index, [x[name] for name in group])
    objective.update(_rounds(problem, cost, x, price))
    problem.setObjective(pulp.LpAffineExpression(objective))
    if memory_bytes is not None:
        usage = {
            var: cost.memory_bytes(layer, g) / 2**20
            for layer in cost.graph.layers
            for g, var in x[layer.name].items()
        }
        _constrain(problem, usage, pulp.LpConstraintLE, memory_bytes / 2**20, "memory")
    return problem, x


def _rounds(
    problem: pulp.LpProblem, cost: CostModel, x: dict[str, dict[int, pulp.LpVariable]], price: float
) -> dict[pulp.LpVariable, float]:
    """Each rank group's all-reduce latency rounds, ``ROUNDS(g) = L(g)·max(1, (1 − ω)·S_g/b)`` when some
    layer with parameters runs on ``g > 1`` ranks: ``used_g ≥ x[l,g]`` for those layers, ``z_g ≥ used_g``,
    ``z_g ≥ (1 − ω)·Σ_l x[l,g]·W_l/b``, cost ``L(g)·z_g`` (the cost model's :meth:`CostModel.rounds_ms`)."""
    objective: dict[pulp.LpVariable, float] = {}
    holders = [layer for layer in cost.graph.layers if cost.param_bytes(layer) > 0]
    share = 1 - cost.network.allreduce_overlap
    for g in sorted({g for layer in holders for g in x[layer.name] if g > 1}):
        latency = cost.round_ms(g)
        if latency <= 0:
            continue
        used = problem.add_variable(f"used_{g}", lowBound=0, upBound=1)
        rounds = problem.add_variable(f"rounds_{g}", lowBound=0)
        members = [layer for layer in holders if g in x[layer.name]]
        for k, layer in enumerate(members):
            _constrain(problem, {used: 1.0, x[layer.name][g]: -1.0}, pulp.LpConstraintGE, 0.0, f"used_{g}_{k}")
        _constrain(problem, {rounds: 1.0, used: -1.0}, pulp.LpConstraintGE, 0.0, f"rounds_{g}")
        if share > 0:
            bytes_in = {x[layer.name][g]: -share * cost.param_bytes(layer) / cost.bucket_bytes for layer in members}
            _constrain(problem, {rounds: 1.0, **bytes_in}, pulp.LpConstraintGE, 0.0, f"buckets_{g}")
        objective[rounds] = latency * (1 + price * g / 1e3)
    return objective


def _tie(problem: pulp.LpProblem, index: int, choices: list[dict[int, pulp.LpVariable]]) -> None:
    """The layers of ``choices`` pick the same count (a count one of them lacks is ruled out)."""
    common = set.intersection(*(set(choice) for choice in choices))
    first = choices[0]
    for k, choice in enumerate(choices):
        for g, var in choice.items():
            if g not in common:
                _constrain(problem, {var: 1.0}, pulp.LpConstraintEQ, 0.0, f"untied_{index}_{k}_{g}")
            elif k:
                _constrain(problem, {var: 1.0, first[g]: -1.0}, pulp.LpConstraintEQ, 0.0, f"tie_{index}_{k}_{g}")


def _constrain(
    problem: pulp.LpProblem, terms: dict[pulp.LpVariable, float], sense: int, rhs: float, name: str
) -> None:
    """Add ``Σ coef·var (sense) rhs`` without building intermediate expressions."""
    problem.addConstraint(pulp.LpConstraint(pulp.LpAffineExpression(terms), sense=sense, rhs=rhs, name=name))


def _edge(
    problem: pulp.LpProblem,
    cost: CostModel,
    index: int,
    src: str,
    xu: dict[int, pulp.LpVariable],
    xv: dict[int, pulp.LpVariable],
) -> dict[pulp.LpVariable, float]:
    """Add edge ``index``'s ladders; return their objective coefficients (both directions).

    The unit of flow from u's count to v's goes straight (equal counts, free)
    or through one ladder: the in-node ladder (only the counts within a node,
    sides ``σ``) or, when some count leaves the node, the cross-node ladder
    (every count, sides ``σ_x``). Either costs ``max`` of the two sides, so the
    cheapest route is exactly the cost model's ``R(g_u, g_v)``.
    """
    if len(xu) == 1 and xu.keys() == xv.keys():
        return {}
    producer = cost.graph.layer(src)
    counts = sorted(set(xu) | set(xv))
    inside = [g for g in counts if g <= cost.network.gpus_per_node]
    sync = {g: cost.sync_ms(g) for g in counts}
    rails = []
    if len(inside) > 1:
        rails.append(_ladder(problem, f"{index}", {g: cost.reshard_side_ms(producer, g) for g in inside}, sync))
    if len(inside) < len(counts):
        rails.append(_ladder(problem, f"{index}x", {g: cost.reshard_side_ms(producer, g, across=True) for g in counts},
                             sync))
    objective: dict[pulp.LpVariable, float] = {}
    for k, g in enumerate(counts):
        stay = problem.add_variable(f"s_{index}_{k}", lowBound=0) if g in xu and g in xv else None
        for end, port, name in ((xu, 0, "from"), (xv, 1, "to")):
            if g not in end:
                continue
            terms = {end[g]: -1.0, **({stay: 1.0} if stay is not None else {})}
            for rail in rails:
                if g in rail.ports[port]:
                    terms[rail.ports[port][g]] = 1.0
            _constrain(problem, terms, pulp.LpConstraintEQ, 0.0, f"{name}_{index}_{k}")
    for rail in rails:
        objective.update(rail.objective)
    return objective


@dataclass(frozen=True)
class _Rail:
    """A ladder's entry and exit variables by count, and its objective coefficients."""

    ports: tuple[dict[int, pulp.LpVariable], dict[int, pulp.LpVariable]]
    objective: dict[pulp.LpVariable, float]


def _ladder(problem: pulp.LpProblem, tag: str, side: dict[int, float], sync: dict[int, float]) -> _Rail:
    """Levels sorted by side descending: enter at ``σ_i``, go down free, up at ``σ_k − σ_{k+1}``, leave free;
    entering from and leaving to count ``g`` adds ``sync[g]`` (the direction that count sends)."""
    levels = sorted(side, key=lambda g: (-side[g], g))
    sides = [side[g] for g in levels]

    def flow(name: str, k: int) -> pulp.LpVariable:
        return problem.add_variable(f"{name}_{tag}_{k}", lowBound=0)

    down = [flow("d", k) for k in range(len(levels) - 1)]
    up = [flow("u", k) for k in range(len(levels) - 1)]
    objective = {var: 2 * (sides[k] - sides[k + 1]) for k, var in enumerate(up)}
    enter: dict[int, pulp.LpVariable] = {}
    leave: dict[int, pulp.LpVariable] = {}
    for k, g in enumerate(levels):
        enter[g], leave[g] = flow("e", k), flow("l", k)
        objective[enter[g]] = 2 * sides[k] + sync[g]
        objective[leave[g]] = sync[g]
        ladder = {enter[g]: 1.0, leave[g]: -1.0}
        if k:
            ladder[down[k - 1]] = 1.0
            ladder[up[k - 1]] = -1.0
        if k < len(up):
            ladder[up[k]] = 1.0
            ladder[down[k]] = -1.0
        _constrain(problem, ladder, pulp.LpConstraintEQ, 0.0, f"ladder_{tag}_{k}")
    return _Rail(ports=(enter, leave), objective=objective)


def _backend(solver: SolverName, time_limit_s: float, *, mip: bool) -> pulp.LpSolver:
    if solver is SolverName.HIGHS:
        options = {} if mip else {"presolve": "off"}
        return pulp.HiGHS(msg=False, timeLimit=time_limit_s, threads=1, mip=mip, **options)
    return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, mip=mip)


def _integral(x: dict[str, dict[int, pulp.LpVariable]]) -> bool:
    return all(
        min(abs(value), abs(1 - value)) < 1e-6
        for choice in x.values()
        for value in (var.varValue or 0.0 for var in choice.values())
    )


def _has_solution(x: dict[str, dict[int, pulp.LpVariable]]) -> bool:
    return all(any((var.varValue or 0) > 0.5 for var in choice.values()) for choice in x.values())


def _status(problem: pulp.LpProblem, relaxed_ok: bool) -> str:
    if relaxed_ok:
        return "optimal (integral LP relaxation)"
    if problem.sol_status == pulp.LpSolutionOptimal:
        return "optimal"
    return f"{pulp.LpSolution[problem.sol_status].lower()} (time limit)"


def _gap(problem: pulp.LpProblem, solver: SolverName) -> float:
    """Relative MIP gap: HiGHS reports it; for CBC 0 when proven optimal, else 1 (unknown)."""
    if solver is SolverName.HIGHS:
        return max(0.0, float(problem.solverModel.getInfo().mip_gap))
    return 0.0 if problem.sol_status == pulp.LpSolutionOptimal else 1.0
