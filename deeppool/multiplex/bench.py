"""``deeppool multiplex bench``: the foreground alone vs with a background, per mode, one invocation.

Each mode is one run of the plan with the background (its A/B blocks give
alone and shared iterations side by side). ``OUT/multiplex.json`` has one
object per mode; ``OUT/interference.json`` is what the simulator reads
(``deeppool simulate --interference``): the measured foreground slowdown and
background efficiency of the mode chosen — the gated mode recovering most
while within the slowdown target — and its efficiency by window length. When
no gated mode qualifies, it is not written (:func:`interference` raises).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from deeppool.errors import DeeppoolError
from deeppool.executor.config import RunConfig
from deeppool.multiplex.api import run
from deeppool.multiplex.config import BackgroundConfig, MuxMode
from deeppool.multiplex.metrics import MultiplexReport

Runner = Callable[..., dict[str, Any]]


def bench(
    plan: Path, background: BackgroundConfig, modes: Sequence[MuxMode], *, config: RunConfig, out: Path,
    runner: Runner = run,
) -> list[MultiplexReport]:
    reports = []
    for mode in modes:
        folder = out / mode.value
        bg = replace(background, mode=mode, checkpoint_dir=folder / "background")
        summary = runner(plan, background=bg, config=replace(config, out_dir=folder))
        reports.append(_report(summary["multiplex"]))
    out.mkdir(parents=True, exist_ok=True)
    (out / "multiplex.json").write_text(json.dumps({r.mode: r.to_json() for r in reports}, indent=2) + "\n")
    (out / "interference.json").unlink(missing_ok=True)  # an older run's choice must not stand for this one
    return reports


def write_interference(reports: Sequence[MultiplexReport], target: float, out: Path) -> Path:
    """``OUT/interference.json`` from :func:`interference` (which refuses, writing nothing)."""
    path = out / "interference.json"
    path.write_text(json.dumps(interference(reports, target), indent=2) + "\n")
    return path


def _report(data: dict[str, Any]) -> MultiplexReport:
    data = {k: v for k, v in data.items() if k != "fg_iteration_ms"}
    data["bg_pids"] = tuple(data["bg_pids"])
    data["bg_errors"] = tuple(data["bg_errors"])
    data["efficiency_by_window_ms"] = tuple((e["window_ms"], e["efficiency"]) for e in data["efficiency_by_window_ms"])
    return MultiplexReport(**data)


def interference(reports: Sequence[MultiplexReport], target: float) -> dict[str, Any]:
    """The simulator's inputs from the gated mode that recovered most within the slowdown ``target``.

    Only a gated mode's efficiency is measured in windows (the free-running modes' work is not), and a mode
    slowed past the target is never chosen: when no gated mode qualifies, nothing is chosen (one line)."""
    gated = [r for r in reports if r.gated]
    within = [r for r in gated if r.fg_slowdown <= target and r.recovered_fraction]
    if not within:
        measured = ", ".join(f"{r.mode} {100 * r.fg_slowdown:+.1f}%"
                             + ("" if r.recovered_fraction is None else f" recovering {100 * r.recovered_fraction:.0f}%")
                             for r in reports)
        why = "no gated mode (gate, priority) ran" if not gated else \
            f"no gated mode did background work with the foreground slowed at most {100 * target:.0f}%"
        raise DeeppoolError(f"interference.json not written: {why} (measured: {measured}); "
                            "re-run with a gated mode, a larger --slowdown-target or on a quieter machine")
    best = max(within, key=lambda r: r.recovered_fraction or 0.0)
    assert best.recovered_fraction is not None
    return {
        "mode": best.mode,
        "fg_slowdown": 1 + max(0.0, best.fg_slowdown),
        "bg_efficiency": best.recovered_fraction,
        "efficiency_by_window_ms": [{"window_ms": w, "efficiency": e} for w, e in best.efficiency_by_window_ms],
        "modes": {r.mode: {"fg_slowdown": r.fg_slowdown, "recovered_fraction": r.recovered_fraction,
                           "fg_taken_ms_per_iteration": r.fg_taken_ms_per_iteration} for r in reports},
    }
