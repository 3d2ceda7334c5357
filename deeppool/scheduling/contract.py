"""The contract between the engine and the policies: snapshots in, decisions out.

A policy is a pure function ``decide(snapshot) -> Decision`` over a typed,
read-only :class:`Snapshot` of the cluster. The engine applies the decision
(preemptions, then starts, then loans) and asks again until the policy has
nothing more to do, so a new policy is a new class in
:mod:`deeppool.scheduling.policies` and never a change to the engine.

For speed, a snapshot's collections are read-only *views* of the engine's
queues (valid for the duration of the ``decide`` call, never copied): a FIFO
policy looks at the head of an 80,000-job queue without paying for the tail.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping, Reversible, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from deeppool.scheduling.choice import ModelChoice


class SpeedModel(Protocol):
    """How fast a job whose batch and GPUs may change trains (a co-adaptive policy's view of it).

    Progress is counted in the model's own units (``total_progress`` to finish); at progress ``p`` the
    job is in epoch ``epoch_at(p)``, and on ``gpus`` GPUs at global ``batch`` it makes
    ``goodput(gpus, batch, epoch)`` progress per second.
    """

    @property
    def total_progress(self) -> float: ...

    @property
    def min_gpus(self) -> int:
        """The fewest GPUs it runs on (its only count, for a job that cannot be resized: ``min = max``)."""
        ...

    @property
    def max_gpus(self) -> int: ...

    def progress_at(self, epoch: int) -> float: ...

    def epoch_at(self, progress: float) -> int: ...

    def goodput(self, gpus: int, batch: int, epoch: int) -> float: ...

    def best_batch(self, gpus: int, epoch: int) -> tuple[int, float]: ...


class PlanMode(enum.Enum):
    """How a job runs on its whole GPUs: every layer on all of them, its fastest burst-parallel plan, or
    the burst plan chosen for the cluster's throughput when its idle time is lent (``--objective cluster``)."""

    DATA_PARALLEL = "dp"
    BURST = "burst"
    LENDING = "lending"


@dataclass(frozen=True, kw_only=True, slots=True)
class SimJob:
    """A job as the simulator runs it: its request, its model and its work in iterations."""

    job_id: int
    name: str
    arrival_s: float
    gpus: int
    background: bool
    model: ModelChoice
    iterations: float
    recorded_duration_s: float
    granularity_ms: float = 0.0
    """Its piece, the work a lent window admits whole (a background job's: its multiplexing mode's; a foreground
    job's: its longest layer phase): a lent window shorter than this holds none of its work."""
    memory_bytes: int = 0
    """Memory of one of its data-parallel ranks: a lent GPU must have this much free."""
    speed: SpeedModel | None = None
    """How fast it trains at any batch and GPU count (Pollux workloads): started with a batch, it runs by this."""

    @property
    def work_gpu_s(self) -> float:
        """The job's work in GPU-seconds under its recorded (data-parallel) allocation."""
        return self.recorded_duration_s * self.gpus


@dataclass(frozen=True, kw_only=True, slots=True)
class Slot:
    """Rank ``rank`` of running foreground job ``host``, idle for ``idle_fraction`` of each iteration.

    ``usable_fraction`` is the share of an iteration background work fills on it: its idle windows,
    each weighted by the interference model's efficiency for a window of its length (before cutting
    them to a guest's step pieces); ``longest_window_ms`` the longest window background work is
    admitted to; ``free_memory_bytes`` the GPU memory its host's rank leaves.
    """

    host: int
    rank: int
    idle_fraction: float
    usable_fraction: float
    longest_window_ms: float = float("inf")
    free_memory_bytes: int = 2**62

    def fits(self, job: SimJob) -> bool:
        """Whether background ``job`` can run here at all: a window holds its step pieces, memory holds its rank."""
        return self.longest_window_ms >= job.granularity_ms and self.free_memory_bytes >= job.memory_bytes


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanOffer:
    """A plan a foreground job can run on its GPUs, as a policy weighs it before choosing.

    ``iteration_s`` alone, ``hosting_iteration_s`` while it hosts background work; ``lendable`` the ranks it
    would lend (``host`` -1: not placed), most usable first, and ``lendable_value[k]`` the usable fractions
    of the first ``k`` of them summed (``lendable_value[0]`` = 0).
    """

    mode: PlanMode
    iteration_s: float
    hosting_iteration_s: float
    lendable: tuple[Slot, ...] = ()
    lendable_value: tuple[float, ...] = (0.0,)


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanState:
    """A job running a plan on whole GPUs: which, since when (its start or its last re-plan), the time it
    needs to finish at its current rate, and what it hosts: guests, its ranks they hold, and the background
    work they do there (GPU-seconds of the guests' own data-parallel plans per second)."""

    mode: PlanMode
    since_s: float
    remaining_s: float
    guests: tuple[int, ...] = ()
    lent_ranks: int = 0
    hosted_rate: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Adaptive:
    """A job run by its speed model: progress made, its batch while running, restarts, the most GPUs it has held."""

    progress: float
    batch: int | None
    restarts: int
    peak_gpus: int


class ReversibleCollection(Collection, Reversible, Protocol):
    """A sized, iterable, reversible read-only view (a dict's ``values()``)."""


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """The cluster as a policy sees it at ``now_s``.

    ``waiting`` holds every waiting job in arrival order (requeued jobs at the
    back), split into ``waiting_fg`` and ``waiting_bg``; ``free_slots`` the
    lendable idle ranks of running foreground jobs; ``preemptible`` the
    background jobs holding whole GPUs (``preemptible_gpus`` of them, oldest
    first); ``guests`` the background jobs running on lent ranks; ``holding``
    every job on whole GPUs (job id -> GPUs held) and ``running`` those jobs;
    ``requeued`` the waiting jobs that ran before (preempted or evicted), in
    (arrival, job id) order, as the other waiting jobs are; ``attained_gpu_s`` the
    GPU-seconds of whole-GPU service each job that ever held whole GPUs has had
    so far (Tiresias' attained service; a job never run is absent); ``adaptive`` the state of every job
    that has run by its speed model (a job never run so is absent); ``round`` counts the decisions
    already taken at this instant (0: the first).
    """

    now_s: float
    total_gpus: int
    free_gpus: int
    waiting: Collection[SimJob]
    waiting_fg: Collection[SimJob]
    waiting_bg: Collection[SimJob]
    free_slots: Collection[Slot]
    preemptible: ReversibleCollection
    preemptible_gpus: int
    guests: Collection[SimJob]
    holding: Mapping[int, int]
    running: Collection[SimJob]
    requeued: Sequence[SimJob]
    attained_gpu_s: Mapping[int, float]
    adaptive: Mapping[int, Adaptive] = field(default_factory=dict)
    round: int = 0
    plans: Mapping[int, PlanState] = field(default_factory=dict)
    """Every job running a plan on whole GPUs (a job run by its speed model is absent)."""
    offers: Mapping[int, Mapping[PlanMode, PlanOffer]] = field(default_factory=dict)
    """The plans each job could run on the GPUs it asks for, looked up on demand (empty: none known)."""
    replan_cost_s: float = 0.0
    """What moving a running job to another plan costs it: seconds of lost time on all its GPUs."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Start:
    """Run ``job_id`` on ``gpus`` whole GPUs with the plan of ``mode``, or, with a ``batch``, by its speed model."""

    job_id: int
    gpus: int
    mode: PlanMode
    batch: int | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class Rebatch:
    """Change the global batch of ``job_id``, running by its speed model, without restarting it."""

    job_id: int
    batch: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Replan:
    """Move running job ``job_id`` to the plan of ``mode`` on the same GPUs; it pays the re-plan cost."""

    job_id: int
    mode: PlanMode


@dataclass(frozen=True, kw_only=True, slots=True)
class Lend:
    """Run background job ``job_id`` data parallel on the idle time of ``slots``."""

    job_id: int
    slots: tuple[Slot, ...]


@dataclass(frozen=True, kw_only=True)
class Decision:
    """What to change now; ``preempt`` names running jobs (on whole GPUs or lent ranks) to requeue.

    A preempted job keeps its progress and pays the engine's restart penalty when it runs again. The engine
    applies preemptions, re-plans, starts, loans and batch changes in that order.
    """

    preempt: tuple[int, ...] = ()
    start: tuple[Start, ...] = ()
    lend: tuple[Lend, ...] = ()
    rebatch: tuple[Rebatch, ...] = ()
    replan: tuple[Replan, ...] = ()
    wake_at_s: float | None = None

    @property
    def empty(self) -> bool:
        return not (self.preempt or self.start or self.lend or self.rebatch or self.replan)


NOTHING = Decision()


class Policy(Protocol):
    """A scheduling policy: ``name`` for reports, ``decide`` for the engine."""

    name: str

    def decide(self, snapshot: Snapshot) -> Decision: ...
