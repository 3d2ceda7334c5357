"""Metrics of a simulated run, and their JSON, CSV and table forms.

* JCT: finish − arrival, averaged and at the 50th and 99th percentiles, over all jobs, and apart over the
  foreground jobs and the background ones (the jobs the background rule demotes: their median and tail
  beside the others').
* makespan: the last completion (the trace starts at 0).
* gpu_utilization: busy GPU-time / (GPUs · makespan); a rank is busy while its
  Plan runs a phase on it, and a lent rank for the share a background job uses.
* fg_throughput / bg_throughput: work completed per second, the work of a job
  being its recorded GPU-time (recorded duration × recorded GPUs) — i.e. in
  "GPUs' worth of data-parallel work"; both are over the makespan.
* cluster_throughput_vs_dp: (fg + bg throughput) over the ``dp`` policy's in
  the same run (DeepPool's "cluster throughput relative to data parallel").
* preemptions / evictions: times a policy requeued a running job / a guest
  lost its host; restart_penalty_gpu_s: the GPU-time they cost on restart;
  replans / replan_gpu_s: times a policy moved a running job to another plan, and the GPU-time that cost.
* lent_gpu_seconds: GPU-time of idle ranks lent to background jobs (held by a
  guest); bg_gpu_seconds_in_windows: the background work done in those
  windows, in GPU-seconds of the guests' own data-parallel plans — the
  background throughput that idle windows, not queueing, produced.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from rich.table import Table

from deeppool.cluster_sim.engine import SimResult
from deeppool.scheduling.policies import BASELINE
from deeppool.cluster_sim.scenario import ScenarioPoint


@dataclass(frozen=True, kw_only=True)
class PolicyMetrics:
    policy: str
    jobs: int
    fg_jobs: int
    bg_jobs: int
    avg_jct_s: float
    p99_jct_s: float
    avg_fg_jct_s: float
    avg_bg_jct_s: float
    p50_jct_s: float
    p50_fg_jct_s: float
    p99_fg_jct_s: float
    p50_bg_jct_s: float
    p99_bg_jct_s: float
    makespan_s: float
    gpu_utilization: float
    fg_throughput: float
    bg_throughput: float
    cluster_throughput: float
    cluster_throughput_vs_dp: float | None
    preemptions: int
    evictions: int
    restart_penalty_gpu_s: float
    lent_gpu_seconds: float
    bg_gpu_seconds_in_windows: float
    replans: int
    replan_gpu_s: float
    events: int
    sim_wall_s: float
    events_per_s: float


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if values.size else 0.0


def _percentile(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else 0.0


def measure(result: SimResult) -> PolicyMetrics:
    records = result.records
    jct = np.array([r.jct_s for r in records])
    background = np.array([r.background for r in records], dtype=bool)
    work = np.array([r.work_gpu_s for r in records])
    span = result.makespan_s if result.makespan_s > 0 else 1.0
    fg = float(work[~background].sum()) / span
    bg = float(work[background].sum()) / span
    return PolicyMetrics(
        policy=result.policy,
        jobs=len(records),
        fg_jobs=int((~background).sum()),
        bg_jobs=int(background.sum()),
        avg_jct_s=_mean(jct),
        p99_jct_s=float(np.percentile(jct, 99)) if jct.size else 0.0,
        avg_fg_jct_s=_mean(jct[~background]),
        avg_bg_jct_s=_mean(jct[background]),
        p50_jct_s=_percentile(jct, 50),
        p50_fg_jct_s=_percentile(jct[~background], 50),
        p99_fg_jct_s=_percentile(jct[~background], 99),
        p50_bg_jct_s=_percentile(jct[background], 50),
        p99_bg_jct_s=_percentile(jct[background], 99),
        makespan_s=result.makespan_s,
        gpu_utilization=result.busy_gpu_s / (result.cluster.gpus * span),
        fg_throughput=fg,
        bg_throughput=bg,
        cluster_throughput=fg + bg,
        cluster_throughput_vs_dp=None,
        preemptions=result.preemptions,
        evictions=result.evictions,
        restart_penalty_gpu_s=result.restart_penalty_gpu_s,
        lent_gpu_seconds=result.lent_gpu_s,
        bg_gpu_seconds_in_windows=result.bg_gpu_s_in_windows,
        replans=result.replans,
        replan_gpu_s=result.replan_gpu_s,
        events=result.events,
        sim_wall_s=result.wall_s,
        events_per_s=result.events / result.wall_s if result.wall_s > 0 else 0.0,
    )


def compare(results: Sequence[SimResult]) -> tuple[PolicyMetrics, ...]:
    """Metrics of every run, with cluster throughput relative to the ``dp`` run when there is one."""
    metrics = [measure(result) for result in results]
    base = next((m for m in metrics if m.policy == BASELINE), None)
    if base is None or base.cluster_throughput <= 0:
        return tuple(metrics)
    return tuple(
        PolicyMetrics(**{**asdict(m), "cluster_throughput_vs_dp": m.cluster_throughput / base.cluster_throughput})
        for m in metrics
    )


def write_metrics(metrics: Sequence[PolicyMetrics], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.json").write_text(json.dumps({m.policy: asdict(m) for m in metrics}, indent=2) + "\n")
    with (out / "metrics.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(asdict(metrics[0])))
        writer.writeheader()
        writer.writerows(asdict(m) for m in metrics)


def write_jobs(results: Sequence[SimResult], out: Path) -> None:
    """Per-job records of every policy: jobs.csv."""
    out.mkdir(parents=True, exist_ok=True)
    with (out / "jobs.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["policy", "job", "name", "background", "gpus", "arrival_s", "start_s", "finish_s", "jct_s",
                         "preemptions", "evictions"])
        for result in results:
            for r in result.records:
                writer.writerow([result.policy, r.job_id, r.name, int(r.background), r.gpus,
                                 f"{r.arrival_s:.3f}", f"{r.start_s:.3f}", f"{r.finish_s:.3f}",
                                 f"{r.jct_s:.3f}", r.preemptions, r.evictions])


THROUGHPUT_NOTE = (
    "thr: the jobs' recorded GPU-seconds of work completed per second of makespan (fg: foreground, bg: background); "
    "vs dp: fg + bg thr over the dp policy's (data parallel on each job's requested GPUs); burst+bg runs the plans "
    "chosen for cluster throughput (--plan-objective)"
)


def table(metrics: Sequence[PolicyMetrics], title: str) -> Table:
    out = Table(title=title, caption=THROUGHPUT_NOTE)
    columns = ("policy", "avg JCT (h)", "p99 JCT (h)", "fg JCT p50/p99 (h)", "bg JCT p50/p99 (h)", "makespan (h)",
               "GPU util", "fg thr (GPU-s/s)", "bg thr (GPU-s/s)", "vs dp", "lent GPU-h", "bg GPU-h in windows",
               "preempted/evicted", "re-plans")
    for column in columns:
        out.add_column(column, justify="left" if column == "policy" else "right")
    for m in metrics:
        ratio = "—" if m.cluster_throughput_vs_dp is None else f"{m.cluster_throughput_vs_dp:.3f}x"
        out.add_row(
            m.policy, f"{m.avg_jct_s / 3600:.2f}", f"{m.p99_jct_s / 3600:.2f}",
            f"{m.p50_fg_jct_s / 3600:.2f}/{m.p99_fg_jct_s / 3600:.2f}",
            f"{m.p50_bg_jct_s / 3600:.2f}/{m.p99_bg_jct_s / 3600:.2f}", f"{m.makespan_s / 3600:.2f}",
            f"{m.gpu_utilization:.1%}", f"{m.fg_throughput:.2f}", f"{m.bg_throughput:.2f}", ratio,
            f"{m.lent_gpu_seconds / 3600:,.1f}", f"{m.bg_gpu_seconds_in_windows / 3600:,.1f}",
            f"{m.preemptions}/{m.evictions}", str(m.replans),
        )
    return out


def scenario_table(points: Sequence[ScenarioPoint], paper: str) -> Table:
    """DeepPool's scenario: cluster throughput over data parallel per model and GPU count, beside the paper's."""
    out = Table(title="one foreground job + unlimited background jobs (DeepPool's evaluation)")
    columns = ("model", "GPUs", "fg batch", "bg piece (ms)", "burst speedup", "fg share", "bg share", "lent",
               "vs dp (all GPUs)", "right-sizing (dp on w)", "vs right-sizing", "paper")
    for column in columns:
        out.add_column(column, justify="left" if column == "model" else "right")
    for p in points:
        out.add_row(p.model, str(p.gpus), str(p.fg_batch), f"{p.piece_ms:.2f}", f"{p.burst_speedup:.2f}x",
                    f"{p.fg_share:.2f}",
                    f"{p.bg_share:.2f}", f"{p.lent_fraction:.0%}", f"{p.cluster_throughput_vs_dp:.2f}x",
                    f"{p.right_sizing_vs_dp:.2f}x (w={p.right_sizing_gpus})", f"{p.vs_right_sizing:.2f}x", paper)
    modes = sorted({p.mux for p in points if p.mux})
    out.caption = ("vs dp: cluster throughput over data parallel on all GPUs (DeepPool's baseline); vs right-sizing: "
                   "over data parallel at its best width w with the other GPUs' background work at full efficiency; "
                   f"bg piece: the background's piece under --mux {'/'.join(modes) or '?'}")
    return out
