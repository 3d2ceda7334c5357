"""Running a plan with a background job, from Python and from ``deeppool run``.

``deeppool.run(plan, background=BackgroundConfig(...))`` refuses what cannot run
(:mod:`deeppool.multiplex.preflight`), starts the private MPS daemon for
``--mux mps``, launches the ranks and returns the run's ``summary.json`` (with
its ``multiplex`` section).
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import Any

from deeppool.executor.config import RunConfig
from deeppool.executor.launch import launch
from deeppool.multiplex import preflight
from deeppool.multiplex.config import BackgroundConfig, MuxMode
from deeppool.multiplex.options import background_args
from deeppool.planner.plan import Plan


def launch_with_background(
    plan_path: Path, *, nproc: int, config: RunConfig, background: BackgroundConfig | None, worker_args: list[str],
) -> None:
    """``deeppool run``'s launch: the background checked first, MPS around the ranks when asked for."""
    if background is not None:
        preflight.check(Plan.load(plan_path), background)
    daemon: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if background is not None and background.mode is MuxMode.MPS:
        from deeppool.multiplex.mps import MpsDaemon

        daemon = MpsDaemon.running()
    with daemon:
        launch(plan_path, nproc=nproc, config=config, worker_args=worker_args + background_args(background))


def run(
    plan: Plan | Path | str, *, background: BackgroundConfig | None = None, config: RunConfig | None = None,
    nproc: int | None = None,
) -> dict[str, Any]:
    """Train ``plan`` on local ranks (with ``background`` in its idle windows); returns ``summary.json``."""
    from deeppool.executor.cli import config_args  # the CLI's option spelling, one place

    config = config or RunConfig(out_dir=Path(tempfile.mkdtemp(prefix="deeppool-run-")))
    if config.out_dir is None:
        config = RunConfig(**{**config.__dict__, "out_dir": Path(tempfile.mkdtemp(prefix="deeppool-run-"))})
    assert config.out_dir is not None
    if isinstance(plan, Plan):
        path = config.out_dir / "plan.json"
        config.out_dir.mkdir(parents=True, exist_ok=True)
        plan.save(path)
    else:
        path = Path(plan)
    gpus = Plan.load(path).gpus
    launch_with_background(path, nproc=nproc or gpus, config=config, background=background,
                           worker_args=config_args(config))
    return json.loads((config.out_dir / "summary.json").read_text())
