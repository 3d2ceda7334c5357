"""A replay from start to end, and what it shows: the tables, ``replay.json`` and ``allocation.png``."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.table import Table

from deeppool.cluster_sim.engine import SimResult
from deeppool.coordinator.client import Client
from deeppool.replay.adaptive import FittedSpeed, replay_adaptive
from deeppool.replay.compare import (
    MeasuredSpeed,
    ReplayComparison,
    SpeedKey,
    compare,
    measured_loans,
    measured_speeds,
)
from deeppool.replay.lending import Loans, lends
from deeppool.replay.live import LiveRun, run_live
from deeppool.replay.plot import Band, draw, live_bands
from deeppool.replay.slicing import ReplaySlice
from deeppool.scheduling.policies import ADAPTIVE, policy_named

JSON_FILE = "replay.json"
PICTURE_FILE = "allocation.png"


@dataclass(frozen=True, kw_only=True)
class ReplayResult:
    slice: ReplaySlice
    live: LiveRun
    speeds: dict[SpeedKey, MeasuredSpeed]
    comparison: ReplayComparison
    simulated: SimResult
    bands: tuple[Band, ...]
    """the simulated run's slots over time"""
    fits: tuple[FittedSpeed, ...] = ()
    """a co-adaptive policy's speed models as the coordinator fitted them (``speeds`` is then empty)"""
    restart_s: float = 0.0
    """the restart the simulation charged (a co-adaptive replay: the live resizes' median cost)"""
    loans: Loans | None = None
    """a lending policy's hosts' plans and the live loans' efficiency"""


def replay(cut: ReplaySlice, client: Client, policy: str, *, interval_s: float | None = None,
           timeout_s: float = 3600.0, say: Callable[[str], None] = lambda line: None) -> ReplayResult:
    """Run ``cut`` live on ``client``'s coordinator (which runs ``policy``, deciding every ``interval_s`` if
    it decides on a tick: ``serve --policy-interval``), then in the simulator: by the speeds the jobs' logs
    measured (:mod:`deeppool.replay.compare`), or, for a co-adaptive policy, by the speed models the
    coordinator fitted (:mod:`deeppool.replay.adaptive`)."""
    live = run_live(cut.jobs, client, timeout_s=timeout_s, say=say)
    if policy in ADAPTIVE:
        adaptive = replay_adaptive(live, policy, interval_s=interval_s)
        return ReplayResult(slice=cut, live=live, speeds={}, comparison=adaptive.comparison,
                            simulated=adaptive.simulated, bands=adaptive.bands, fits=adaptive.fits,
                            restart_s=adaptive.restart_s)
    speeds = measured_speeds(live)
    loans = measured_loans(live, speeds) if lends(policy_named(policy)) else None
    comparison, simulated, bands = compare(live, policy, speeds, lending=loans)
    return ReplayResult(slice=cut, live=live, speeds=speeds, comparison=comparison, simulated=simulated,
                        bands=tuple(bands), loans=loans)


def slice_table(cut: ReplaySlice) -> Table:
    table = Table(title=f"{len(cut.jobs)} jobs of {Path(cut.source).name} from job {cut.settings.first}: time x "
                        f"{cut.time_scale:.4f}, {cut.gpu_scale:g} trace GPUs a slot")
    for column in ("#", "job", "arrives s", "trace GPUs", "slots", "model", "batch", "steps", "trace run s",
                   "sized for s"):
        table.add_column(column, justify="left" if column in ("job", "model") else "right")
    for index, job in enumerate(cut.jobs):
        table.add_row(str(index), job.name, f"{job.arrival_s:.1f}", str(job.trace.gpus),
                      f"{job.gpus} bg" if job.background else str(job.gpus),
                      job.model.name, str(job.batch), str(job.steps), f"{job.trace.duration_s:.0f}",
                      f"{job.run_s:.1f}")
    return table


def speed_table(speeds: dict[SpeedKey, MeasuredSpeed]) -> Table:
    table = Table(title="speeds measured live (medians over the jobs of each model, batch and slots)")
    for column in ("model", "batch", "slots", "jobs", "iteration ms", "start-up s"):
        table.add_column(column, justify="left" if column == "model" else "right")
    for speed in sorted(speeds.values(), key=lambda s: (s.model, s.batch, s.gpus)):
        table.add_row(speed.model, str(speed.batch), str(speed.gpus), str(speed.jobs),
                      f"{speed.iteration_s * 1e3:.1f}", f"{speed.start_up_s:.1f}")
    return table


def fit_table(fits: tuple[FittedSpeed, ...]) -> Table:
    table = Table(title="speed models the coordinator fitted (T = alpha + beta * batch / slots, over the points "
                        "of each model's jobs)")
    for column in ("model", "jobs", "points (slots, batch, ms)", "alpha ms", "beta ms/sample", "noise scale",
                   "start-up s"):
        table.add_column(column, justify="left" if column in ("model", "points (slots, batch, ms)") else "right")
    for fit in fits:
        points = ", ".join(f"({g}, {b}, {s * 1e3:.0f})" for g, b, s in fit.points) or "none"
        noise = "-" if fit.noise_scale is None else f"{fit.noise_scale:.1f}"
        table.add_row(fit.model, str(fit.jobs), points, f"{fit.alpha_s * 1e3:.1f}", f"{fit.beta_s * 1e3:.2f}",
                      noise, f"{fit.start_up_s:.1f}")
    return table


def resizes_line(live: LiveRun) -> str:
    """How many resizes the live run's coordinator made, by how each ended (the coordinator's records)."""
    phases: dict[str, int] = {}
    for record in live.records:
        for change in record.speed.resizes if record.speed is not None else ():
            phases[change.phase] = phases.get(change.phase, 0) + 1
    shown = ", ".join(f"{count} {phase.lower()}" for phase, count in sorted(phases.items()))
    return f"resizes in the live run: {sum(phases.values())}" + (f" ({shown})" if shown else "")


def loans_line(result: ReplayResult) -> str:
    """What the live run's loans were, and the guests' efficiency the simulation ran them at."""
    loans = result.loans
    if loans is None:
        return ""
    background = [r for r in result.live.records if r.job.background]
    lending = loans.lending
    measured = (f"{lending.efficiency:.2f} of the lent ranks' idle time became guest progress (the simulation's "
                f"efficiency); each restart of a background job charged {lending.restart_s:.1f} s" if lending.loans
                else f"nothing was lent: the simulation lends at the default efficiency {lending.efficiency:.2f}")
    hosts = sorted({(r.job.model.name, r.job.gpus) for r in result.live.records if not r.job.background
                    and max(loans.planned(r.job.model, r.job.gpus).idle_fractions, default=0.0) > 0})
    offered = ", ".join(f"{model} on {gpus}" for model, gpus in hosts) or "none"
    return (f"background jobs: {len(background)}, of which {lending.guests} were lent a running job's idle ranks "
            f"live ({lending.loans} loans); plans with idle ranks (model on slots): {offered}; {measured}")


def comparison_table(comparisons: list[ReplayComparison]) -> Table:
    table = Table(title="live against simulated (gap: simulated / live - 1; steps only: the simulation without "
                        "start-up)")
    for column in ("policy", "avg JCT live s", "simulated s", "gap", "makespan live s", "simulated s", "gap",
                   "steps only: JCT s", "makespan s"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for item in comparisons:
        table.add_row(item.policy, f"{item.live.average_jct_s:.1f}", f"{item.simulated.average_jct_s:.1f}",
                      f"{item.jct_gap:+.1%}", f"{item.live.makespan_s:.1f}", f"{item.simulated.makespan_s:.1f}",
                      f"{item.makespan_gap:+.1%}", f"{item.steps_only.average_jct_s:.1f}",
                      f"{item.steps_only.makespan_s:.1f}")
    return table


def write(result: ReplayResult, out: Path) -> list[Path]:
    """``replay.json`` (the slice, every live job, the speeds, the comparison, the simulated jobs) and the
    picture, in ``out``; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    picture = out / PICTURE_FILE
    draw([(f"live: coordinator at {result.live.url}, policy {result.comparison.policy}", live_bands(result.live)),
          ("simulated: the same jobs and policy, speeds measured live", result.bands)],
         result.live.slots, picture)
    data = out / JSON_FILE
    data.write_text(json.dumps(_json(result), indent=2))
    return [data, picture]


def _json(result: ReplayResult) -> dict[str, Any]:
    cut = result.slice
    return {
        "source": cut.source, "settings": _settings(cut), "time_scale": cut.time_scale,
        "gpu_scale": cut.gpu_scale, "slots": result.live.slots, "policy": result.comparison.policy,
        "comparison": {"live": asdict(result.comparison.live), "simulated": asdict(result.comparison.simulated),
                       "steps_only": asdict(result.comparison.steps_only), "jct_gap": result.comparison.jct_gap,
                       "makespan_gap": result.comparison.makespan_gap},
        "speeds": [asdict(speed) for speed in result.speeds.values()],
        "fits": [asdict(fit) for fit in result.fits], "restart_s": result.restart_s,
        "lending": asdict(result.loans.lending) if result.loans is not None else None,
        "live": [{"name": r.job.name, "job_id": r.job_id, "model": r.job.model.name, "batch": r.job.batch,
                  "slots": r.job.gpus, "steps": r.job.steps, "background": r.job.background,
                  "submitted_s": r.submitted_s, "held": r.held, "hosts": r.hosts, "gained": r.gained,
                  "widths": r.widths, "state": r.state.value, "iteration_s": r.iteration_s, "jct_s": r.jct_s,
                  "coordinator": r.speed.model_dump(mode="json") if r.speed is not None else None}
                 for r in result.live.records],
        "simulated": [{"name": r.name, "start_s": r.start_s, "finish_s": r.finish_s, "jct_s": r.jct_s}
                      for r in result.simulated.records],
        "simulated_widths": [asdict(band) for band in result.bands],
    }


def _settings(cut: ReplaySlice) -> dict[str, Any]:
    settings = asdict(cut.settings)
    settings["background"] = cut.settings.background.describe() if cut.settings.background is not None else None
    return settings
