"""``deeppool multiplex bench``: the foreground alone vs with a background, per mode, one invocation.

Each mode is one run of the plan with the background (its A/B blocks give
alone and shared iterations side by side). ``OUT/multiplex.json`` has one
object per mode; ``OUT/interference.json`` is what the simulator reads
(``deeppool simulate --interference``): the measured foreground slowdown and
background efficiency of the mode chosen (the one recovering most while within
the slowdown target, else the least slowed), and efficiency by window length.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

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
    (out / "interference.json").write_text(json.dumps(interference(reports, background.slowdown_target), indent=2) + "\n")
    return reports


def _report(data: dict[str, Any]) -> MultiplexReport:
    data = {k: v for k, v in data.items() if k != "fg_iteration_ms"}
    data["bg_pids"] = tuple(data["bg_pids"])
    data["bg_errors"] = tuple(data["bg_errors"])
    data["efficiency_by_window_ms"] = tuple((e["window_ms"], e["efficiency"]) for e in data["efficiency_by_window_ms"])
    return MultiplexReport(**data)


def interference(reports: Sequence[MultiplexReport], target: float) -> dict[str, Any]:
    """The simulator's inputs from the best mode measured (``none`` is the baseline, never chosen if others ran)."""
    candidates = [r for r in reports if r.mode != MuxMode.NONE.value] or list(reports)
    within = [r for r in candidates if r.fg_slowdown <= target]
    best = max(within, key=lambda r: r.recovered_fraction) if within else min(candidates, key=lambda r: r.fg_slowdown)
    return {
        "mode": best.mode,
        "fg_slowdown": 1 + max(0.0, best.fg_slowdown),
        "bg_efficiency": min(1.0, max(best.recovered_fraction, 1e-3)),
        "efficiency_by_window_ms": [{"window_ms": w, "efficiency": e} for w, e in best.efficiency_by_window_ms],
        "modes": {r.mode: {"fg_slowdown": r.fg_slowdown, "recovered_fraction": r.recovered_fraction} for r in reports},
    }
