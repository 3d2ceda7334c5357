"""Foreground Plans for simulated jobs: solved by the planner, cached, reduced to facts.

For every (model, global batch, GPU count) a job may run on, the planner's
:func:`deeppool.planner.api.plan_graph` is called once; it solves the burst
strategy (the ILP by default) and costs both baselines in the same run, so the
data-parallel Plan comes from the same call. Each Plan is reduced to
:class:`PlanFacts` — its predicted iteration time, GPU-seconds per iteration
and every rank's idle fraction — which is all the simulator reads.

Plans are cached in memory and on disk (``cache_dir``), keyed by the model
file's content, the batch, the GPU count, the strategy, the device and network
and a fingerprint of the planner's source, so an 82,000-job trace solves a few
dozen ILPs once, and later runs solve none. Traced graphs are cached the same way.
Missing plans are solved one model per worker process (tracing dominates).
The planner's tracing and solving modules (and torch with them) are imported
only when a Plan or graph is missing from the cache.
"""

from __future__ import annotations

import ast
import enum
import hashlib
import json
import multiprocessing
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import deeppool
from deeppool.cluster_sim.cluster import ClusterSpec
from deeppool.errors import DeeppoolError
from deeppool.interrupt import children_start_deaf, die_on_interrupt
from deeppool.model.graph import LayerGraph
from deeppool.model.loading import load_model
from deeppool.plans import Objective
from deeppool.plans.jsonio import write_json
from deeppool.planner.profiling.interference import InterferenceModel
from deeppool.scheduling.choice import ModelChoice
from deeppool.scheduling.contract import PlanMode

if TYPE_CHECKING:  # the planner's solving half imports torch: loaded only when a Plan must be solved
    from deeppool.plans import Plan
    from deeppool.planner.api import Planned

FACTS_VERSION = 7
"""Bumped whenever the cost model changes what a Plan predicts (4: per-group all-reduce latency rounds,
synchronisation latency, the loss and the optimizer's fixed costs; 5: the lending plan and right-sizing;
7: the ILP built as one sparse matrix for HiGHS), so cached facts are solved again."""


@dataclass(frozen=True, kw_only=True)
class PlanFacts:
    """What the simulator reads of a Plan."""

    iteration_s: float
    gpu_seconds_per_iteration: float
    idle_fractions: tuple[float, ...]
    idle_windows_ms: tuple[tuple[float, ...], ...] = ()
    """Each rank's idle window lengths (ms), for efficiency by window length; empty in hand-made facts."""
    granularity_ms: float = 0.0
    """The longest single layer phase (forward or backward) on a rank: the job's indivisible step piece."""
    rank_memory_bytes: tuple[int, ...] = ()
    """Each rank's memory (the layers it runs); empty in hand-made facts (no memory used)."""
    right_sizing_gpus: int = 0
    right_sizing_throughput: float = 0.0
    """The strong baseline: data parallel at its best width, the GPUs it leaves at full efficiency
    (over data parallel on all GPUs); 0 in hand-made facts."""

    @classmethod
    def of(cls, plan: Plan) -> PlanFacts:
        """Idle fraction of rank r = Σ its idle windows / iteration time; rank memory = Σ its layers' memory."""
        iteration_ms = plan.predicted.iteration_ms
        windows: list[list[float]] = [[] for _ in range(plan.gpus)]
        for window in plan.predicted.idle_windows:
            windows[window.rank].append(window.length_ms)
        memory = [0] * plan.gpus
        for layer in plan.layers:
            for rank in layer.ranks:
                memory[rank] += layer.memory_bytes
        return cls(
            iteration_s=iteration_ms / 1e3,
            gpu_seconds_per_iteration=plan.predicted.gpu_seconds_per_iteration,
            idle_fractions=tuple(min(1.0, max(0.0, sum(w) / iteration_ms)) if iteration_ms > 0 else 0.0
                                 for w in windows),
            idle_windows_ms=tuple(tuple(w) for w in windows),
            granularity_ms=max((max(layer.fwd_ms, layer.bwd_ms) for layer in plan.layers), default=0.0),
            rank_memory_bytes=tuple(memory),
            right_sizing_gpus=plan.cluster.right_sizing_gpus if plan.cluster is not None else 0,
            right_sizing_throughput=plan.cluster.right_sizing_throughput if plan.cluster is not None else 0.0,
        )

    def rank_memory(self, rank: int) -> int:
        return self.rank_memory_bytes[rank] if self.rank_memory_bytes else 0

    @property
    def peak_rank_memory_bytes(self) -> int:
        return max(self.rank_memory_bytes, default=0)

    def windows_ms(self, rank: int) -> tuple[float, ...]:
        """Rank ``rank``'s idle windows (one window of the whole idle time when lengths are unknown)."""
        if self.idle_windows_ms:
            return self.idle_windows_ms[rank]
        return (self.idle_fractions[rank] * self.iteration_s * 1e3,)

    @property
    def gpus(self) -> int:
        return len(self.idle_fractions)


class BurstStrategy(enum.Enum):
    """The planner strategies that make burst plans (values as the planner's ``Strategy`` spells them)."""

    ILP = "ilp"
    DEEPPOOL = "deeppool"


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """How burst plans are made: strategy (ILP or the DeepPool programme), solver time limit, and the
    objective of the plans whose idle time is lent (``PlanMode.LENDING``: the cluster's throughput under
    ``interference`` by default, :mod:`deeppool.planner.solve.throughput`; ``time`` lends the fastest plan)."""

    burst_strategy: BurstStrategy = BurstStrategy.ILP
    time_limit_s: float = 30.0
    amplification: float | None = None
    lending_objective: Objective = Objective.CLUSTER
    interference: InterferenceModel = InterferenceModel()

    def key(self) -> list[object]:
        """What the cached plans depend on."""
        return [self.burst_strategy.value, self.time_limit_s, self.amplification, self.lending_objective.value,
                asdict(self.interference)]


TRACER_SOURCES = ("model/graph.py", "model/layer_exec.py", "model/loading.py", "model/trace.py", "plans/spec.py",
                  "plans/branch.py")
PLANNER_SOURCES = TRACER_SOURCES + (
    "plans/*.py", "planner/api.py", "planner/hardware.py", "planner/request.py", "planner/strategies.py",
    "planner/solve/*.py", "planner/profiling/profile.py", "planner/profiling/interference.py",
)
"""The sources a Plan depends on, as globs under the package (reports and the profiler's measuring do not
change one)."""


def planner_fingerprint(patterns: tuple[str, ...]) -> str:
    """A hash of the code of the sources ``patterns`` name: cached results are stale once one of them changes.

    The code, not the text: a source is hashed as its syntax tree without its docstrings and bare strings
    (comments are not in it), so a change of prose leaves the cache valid."""
    package = Path(deeppool.__file__).parent
    digest = hashlib.sha256()
    for path in sorted({path for pattern in patterns for path in package.glob(pattern)}):
        digest.update(path.relative_to(package).as_posix().encode() + _code(path.read_text()).encode())
    return digest.hexdigest()[:16]


def _code(source: str) -> str:
    """``source``'s syntax tree without its string statements (docstrings, attribute docstrings), as text."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            kept = [stmt for stmt in body if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
                                                  and isinstance(stmt.value.value, str))]
            node.body = kept or [ast.Pass()]
    return ast.dump(tree)


class PlanBook:
    """Facts of the Plan of every (model, GPUs, mode), solved once and cached."""

    def __init__(self, *, cluster: ClusterSpec, settings: PlanSettings, cache_dir: Path | None) -> None:
        self.cluster = cluster
        self.settings = settings
        self.cache_dir = cache_dir
        self.solved = 0
        self._facts: dict[tuple[ModelChoice, int, PlanMode], PlanFacts] = {}
        self._graphs: dict[ModelChoice, LayerGraph] = {}
        self._fingerprint = planner_fingerprint(PLANNER_SOURCES)
        self._tracer_fingerprint = planner_fingerprint(TRACER_SOURCES)

    def hosting(self, piece_ms: float) -> PlanBook:
        """This book with its lending plans chosen for background work in indivisible pieces of ``piece_ms``
        (the guest's piece under the multiplexing mode): a window shorter than a piece holds none of it. Traced graphs are
        shared; the plans are cached apart (the piece is part of the settings' key)."""
        interference = self.settings.interference
        if piece_ms == interference.bg_piece_ms:
            return self
        book = PlanBook(cluster=self.cluster, settings=replace(
            self.settings, interference=replace(interference, bg_piece_ms=piece_ms)), cache_dir=self.cache_dir)
        book._graphs = self._graphs
        return book

    def facts(self, model: ModelChoice, gpus: int, mode: PlanMode) -> PlanFacts:
        key = (model, gpus, mode)
        if key not in self._facts:
            self._load_or_solve(model, gpus)
        return self._facts[key]

    def prepare(
        self,
        needs: Iterable[tuple[ModelChoice, int]],
        advance: Callable[[int], None] = lambda done: None,
        *,
        workers: int = 1,
    ) -> None:
        """Load or solve the plans of every (model, GPUs) in ``needs``.

        Cached plans are loaded here; the rest are solved one model per worker
        process when ``workers`` > 1 (each worker traces its model once).
        """
        missing: dict[ModelChoice, list[int]] = {}
        for model, gpus in needs:
            if not self._load_cached(model, gpus):
                missing.setdefault(model, []).append(gpus)
            else:
                advance(1)
        if workers > 1 and len(missing) > 1:
            self._solve_in_pool(missing, advance, workers)
        for model, counts in missing.items():
            for gpus in counts:
                self.facts(model, gpus, PlanMode.BURST)
                advance(1)

    def _solve_in_pool(self, missing: dict[ModelChoice, list[int]], advance: Callable[[int], None], workers: int) -> None:
        context = multiprocessing.get_context("spawn")
        tasks = [(self.cluster, self.settings, self.cache_dir, model, tuple(counts)) for model, counts in missing.items()]
        with children_start_deaf():
            pool = context.Pool(processes=min(workers, len(missing)), initializer=die_on_interrupt)
        with pool:  # leaving it (an error, Ctrl-C) terminates the workers
            for model, solved in pool.imap_unordered(_solve_task, tasks):
                for gpus, facts in solved.items():
                    self._store(model, gpus, facts)
                self.solved += len(solved)
                advance(len(solved))
                missing[model] = []

    def _load_cached(self, model: ModelChoice, gpus: int) -> bool:
        if (model, gpus, PlanMode.BURST) in self._facts:
            return True
        path = self._cache_path(model, gpus)
        if path is None or not path.is_file():
            return False
        try:
            self._store(model, gpus, _read_facts(path))
        except (ValueError, KeyError, TypeError):
            return False  # a corrupted cache entry is solved again
        return True

    def _load_or_solve(self, model: ModelChoice, gpus: int) -> None:
        if self._load_cached(model, gpus):
            return
        facts = self._solve(model, gpus)
        self._store(model, gpus, facts)
        path = self._cache_path(model, gpus)
        if path is not None:
            write_json(path, {"version": FACTS_VERSION, **{m.value: asdict(f) for m, f in facts.items()}})

    def _store(self, model: ModelChoice, gpus: int, facts: dict[PlanMode, PlanFacts]) -> None:
        for mode, fact in facts.items():
            self._facts[(model, gpus, mode)] = fact

    def _solve(self, model: ModelChoice, gpus: int) -> dict[PlanMode, PlanFacts]:
        from deeppool.plans import Strategy
        from deeppool.planner.api import PlanRequest, device_setup, plan_graph

        graph = self.graph(model)
        profile, _ = device_setup(self.cluster.device.value, model.global_batch, model.global_batch, graph)
        request = PlanRequest(
            gpus=gpus,
            global_batch=model.global_batch,
            strategy=Strategy(self.settings.burst_strategy.value),
            amplification=self.settings.amplification,
            time_limit_s=self.settings.time_limit_s,
            interference=self.settings.interference,
            interference_source="the simulator's interference model",
        )
        lends = request.strategy is Strategy.ILP and self.settings.lending_objective is not Objective.TIME
        try:
            planned = plan_graph(graph, profile, self.cluster.network, request, model=model.spec)
            lending = plan_graph(graph, profile, self.cluster.network,
                                 replace(request, objective=self.settings.lending_objective),
                                 model=model.spec) if lends else planned
        except DeeppoolError as err:
            raise DeeppoolError(f"model '{model.name}' (batch {model.global_batch}) on {gpus} GPU(s): {err}") from None
        self.solved += 1
        return {
            PlanMode.BURST: PlanFacts.of(planned.plan),
            PlanMode.LENDING: PlanFacts.of(lending.plan),
            PlanMode.DATA_PARALLEL: PlanFacts.of(_data_parallel_plan(planned, model, gpus)),
        }

    def graph(self, model: ModelChoice) -> LayerGraph:
        """The model's layer graph: traced once per run, and cached on disk."""
        if model not in self._graphs:
            self._graphs[model] = self._load_or_trace(model)
        return self._graphs[model]

    def _load_or_trace(self, model: ModelChoice) -> LayerGraph:
        path = None
        if self.cache_dir is not None:
            identity = {**self._model_identity(model), "planner": self._tracer_fingerprint}
            path = self.cache_dir / "graphs" / f"{_digest(identity)}.json"
            if path.is_file():
                try:
                    return LayerGraph.from_json(json.loads(path.read_text()))
                except (ValueError, KeyError, TypeError, DeeppoolError):
                    pass
        from deeppool.model.trace import trace

        graph = trace(load_model(model.spec, meta=True)).graph
        if path is not None:
            write_json(path, graph.to_json())
        return graph

    def _model_identity(self, model: ModelChoice) -> dict[str, object]:
        content = hashlib.sha256(model.path.read_bytes()).hexdigest() if model.path.is_file() else str(model.path)
        return {"model": content, "planner": self._fingerprint}

    def _cache_path(self, model: ModelChoice, gpus: int) -> Path | None:
        if self.cache_dir is None:
            return None
        key = {
            **self._model_identity(model),
            "batch": model.global_batch,
            "gpus": gpus,
            "device": self.cluster.device.value,
            "network": self.cluster.network.to_json(),
            "settings": self.settings.key(),
            "version": FACTS_VERSION,
        }
        return self.cache_dir / "plans" / f"{_digest(key)}.json"


def _solve_task(
    task: tuple[ClusterSpec, PlanSettings, Path | None, ModelChoice, tuple[int, ...]],
) -> tuple[ModelChoice, dict[int, dict[PlanMode, PlanFacts]]]:
    return task[3], _solve_model(*task)


def _solve_model(
    cluster: ClusterSpec, settings: PlanSettings, cache_dir: Path | None, model: ModelChoice, counts: tuple[int, ...]
) -> dict[int, dict[PlanMode, PlanFacts]]:
    """Worker process: trace ``model`` once and solve its plans for every count."""
    book = PlanBook(cluster=cluster, settings=settings, cache_dir=cache_dir)
    return {gpus: {mode: book.facts(model, gpus, mode) for mode in PlanMode} for gpus in counts}


def _data_parallel_plan(planned: Planned, model: ModelChoice, gpus: int) -> Plan:
    """The data-parallel Plan of the same planner run (the same cost model and baselines)."""
    from deeppool.plans import Strategy
    from deeppool.planner.solve.baselines import Baselines
    from deeppool.planner.solve.build import build_plan

    if planned.plan.strategy is Strategy.DATA_PARALLEL:
        return planned.plan
    predicted = planned.plan.predicted
    baselines = Baselines(
        data_parallel_ms=predicted.data_parallel_iteration_ms,
        deeppool_ms=predicted.deeppool_iteration_ms,
        best_data_parallel_gpus=predicted.best_data_parallel_gpus,
        best_data_parallel_ms=predicted.best_data_parallel_iteration_ms,
    )
    return build_plan(
        planned.cost,
        planned.assignments[Strategy.DATA_PARALLEL],
        model=model.spec,
        gpus=gpus,
        strategy=Strategy.DATA_PARALLEL,
        amplification_limit=planned.plan.amplification_limit,
        solver=planned.plan.solver,
        baselines=baselines,
    )


def _read_facts(path: Path) -> dict[PlanMode, PlanFacts]:
    payload = json.loads(path.read_text())
    if payload.get("version") != FACTS_VERSION:
        raise ValueError("stale cache entry")
    return {
        mode: PlanFacts(
            iteration_s=float(payload[mode.value]["iteration_s"]),
            gpu_seconds_per_iteration=float(payload[mode.value]["gpu_seconds_per_iteration"]),
            idle_fractions=tuple(float(f) for f in payload[mode.value]["idle_fractions"]),
            idle_windows_ms=tuple(tuple(float(w) for w in rank) for rank in payload[mode.value]["idle_windows_ms"]),
            granularity_ms=float(payload[mode.value]["granularity_ms"]),
            rank_memory_bytes=tuple(int(b) for b in payload[mode.value]["rank_memory_bytes"]),
            right_sizing_gpus=int(payload[mode.value]["right_sizing_gpus"]),
            right_sizing_throughput=float(payload[mode.value]["right_sizing_throughput"]),
        )
        for mode in PlanMode
    }


def _digest(payload: object) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]
