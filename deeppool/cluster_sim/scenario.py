"""DeepPool's own evaluation as a scenario: one foreground job and an unlimited supply of background jobs.

DeepPool (Park et al., MLSys 2022) reports *cluster throughput* — the
foreground's training throughput plus the background jobs', normalised to the
foreground alone under data parallelism — of 1.2x to 2.3x. The scenario puts
one foreground job of ``model`` on all ``gpus`` GPUs of a cluster, and one
single-GPU background job per GPU waiting from the start (more than the
foreground can ever lend, so the supply never runs out), and runs the same
engine and ``burst+bg`` policy as trace runs until the foreground finishes:
loans are exact, memory and window length are checked, guests progress only
in lent windows at the interference model's rate.

With ``T_dp``, ``T_fg`` the foreground's data-parallel and achieved iteration
times (``T_fg`` = its burst Plan's, times the slowdown while it hosts) and
``W`` the background work done in lent windows (GPU-seconds of the guests'
own one-GPU runs) up to the foreground's finish ``t``:

    fg_share = T_dp / T_fg,   bg_share = W / (gpus · t),
    cluster_throughput_vs_dp = fg_share + bg_share   (data parallel alone: 1).

The foreground runs the plan ``burst+bg`` lends (``PlanMode.LENDING``: by default the
one maximising this very throughput, :mod:`deeppool.planner.solve.throughput`, for the guests
it hosts: their steps come in the pieces of the multiplexing mode, :class:`Pieces`, and a
window holds only whole pieces, as the engine counts them). Beside data
parallel on all GPUs (DeepPool's baseline) each point gives the strong baseline,
*right-sizing*: data parallel at the width ``w`` maximising ``T_dp/T_w + (G − w)/G``,
the ``G − w`` GPUs it leaves running background work at full efficiency.

Batches: the foreground trains at ``max(reference batch, gpus)`` (strong
scaling, DeepPool's regime, down to one sample per GPU); each background job
at the model's per-GPU batch on one GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from deeppool.cluster_sim.cluster import ClusterSpec
from deeppool.cluster_sim.engine import Simulation
from deeppool.cluster_sim.plans import PlanBook, PlanMode
from deeppool.cluster_sim.runner import piece_ms
from deeppool.planner.profiling.interference import InterferenceModel, Pieces
from deeppool.scheduling.choice import ModelChoice
from deeppool.scheduling.contract import SimJob
from deeppool.scheduling.policies import POLICIES

PAPER_RANGE = (1.2, 2.3)
"""DeepPool's reported cluster throughput over data parallel (Park et al., MLSys 2022)."""
FOREGROUND_ITERATIONS = 1000.0
ENDLESS_ITERATIONS = 1e15
POLICY = "burst+bg"


@dataclass(frozen=True, kw_only=True)
class ScenarioPoint:
    model: str
    gpus: int
    fg_batch: int
    bg_batch: int
    burst_speedup: float
    fg_share: float
    bg_share: float
    lent_fraction: float
    cluster_throughput_vs_dp: float
    guests: int
    right_sizing_gpus: int = 0
    right_sizing_vs_dp: float = 0.0
    """The strong baseline: data parallel at its best width, the rest of the GPUs at full efficiency."""
    lent_gpu_hours: float = 0.0
    bg_gpu_hours_in_windows: float = 0.0
    piece_ms: float = 0.0
    """The background's piece under the multiplexing mode the point assumes."""
    mux: str = ""

    @property
    def vs_right_sizing(self) -> float:
        return self.cluster_throughput_vs_dp / self.right_sizing_vs_dp if self.right_sizing_vs_dp > 0 else 0.0


def scenario_models(model: ModelChoice, gpus: int) -> tuple[ModelChoice, ModelChoice]:
    """The foreground at ``max(reference batch, gpus)`` and the background at the per-GPU batch."""
    per_gpu = model.per_gpu_batch or max(1, model.global_batch // gpus)
    foreground = replace(model, global_batch=max(model.global_batch, gpus), per_gpu_batch=None)
    background = replace(model, global_batch=per_gpu, per_gpu_batch=None)
    return foreground, background


def evaluate(
    model: ModelChoice, gpus: int, *, gpus_per_node: int, book: PlanBook, interference: InterferenceModel,
    pieces: Pieces | None = None,
) -> ScenarioPoint:
    """Run the scenario for ``model`` on ``gpus`` GPUs (``book`` plans for a cluster of that node size), the
    background cut in the pieces of ``pieces``' mode (default ``priority``)."""
    pieces = Pieces() if pieces is None else pieces
    cluster = ClusterSpec(gpus=gpus, gpus_per_node=min(gpus_per_node, gpus), device=book.cluster.device)
    foreground, background = scenario_models(model, gpus)
    own = book.facts(background, 1, PlanMode.DATA_PARALLEL)
    piece = piece_ms(background, 1, book, pieces)
    book = book.hosting(piece)
    jobs = [SimJob(job_id=0, name="foreground", arrival_s=0.0, gpus=gpus, background=False, model=foreground,
                   iterations=FOREGROUND_ITERATIONS, recorded_duration_s=0.0)]
    jobs += [
        SimJob(job_id=index, name=f"background-{index}", arrival_s=0.0, gpus=1, background=True, model=background,
               iterations=ENDLESS_ITERATIONS, recorded_duration_s=0.0, granularity_ms=piece,
               memory_bytes=own.peak_rank_memory_bytes)
        for index in range(1, gpus + 1)
    ]
    result = Simulation(cluster=cluster, jobs=jobs, policy=POLICIES[POLICY], facts=book.facts,
                        interference=interference, restart_penalty_s=0.0).run()
    finish = next(r.finish_s for r in result.records if r.job_id == 0)
    dp = book.facts(foreground, gpus, PlanMode.DATA_PARALLEL)
    burst = book.facts(foreground, gpus, PlanMode.LENDING)
    fg_share = FOREGROUND_ITERATIONS * dp.iteration_s / finish
    bg_share = result.bg_gpu_s_in_windows / (gpus * finish)
    return ScenarioPoint(
        model=model.name, gpus=gpus, fg_batch=foreground.global_batch, bg_batch=background.global_batch,
        burst_speedup=dp.iteration_s / burst.iteration_s, fg_share=fg_share, bg_share=bg_share,
        lent_fraction=result.lent_gpu_s / (gpus * finish), cluster_throughput_vs_dp=fg_share + bg_share,
        guests=sum(1 for r in result.records if r.background and r.start_s < finish),
        right_sizing_gpus=burst.right_sizing_gpus, right_sizing_vs_dp=burst.right_sizing_throughput,
        lent_gpu_hours=result.lent_gpu_s / 3600, bg_gpu_hours_in_windows=result.bg_gpu_s_in_windows / 3600,
        piece_ms=piece, mux=pieces.mode.value,
    )
