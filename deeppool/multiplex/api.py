"""Running a plan with a background job, from Python and from ``deeppool run``.

``deeppool.run(plan, background=BackgroundConfig(...))`` refuses what cannot run
(:mod:`deeppool.multiplex.preflight`), starts the private MPS daemon for
``--mux mps``, launches the ranks and returns the run's ``summary.json`` (with
its ``multiplex`` section).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deeppool.executor.config import DataConfig, Nodes, RunConfig
from deeppool.executor.launch.launch import launch
from deeppool.executor.launch.worker_args import config_args
from deeppool.multiplex import preflight
from deeppool.multiplex.config import BackgroundConfig, MuxMode
from deeppool.multiplex.options import background_args
from deeppool.errors import DeeppoolError
from deeppool.planner.modelspec import ModelSource, ModelSpec
from deeppool.planner.plan import Plan

if TYPE_CHECKING:
    from torch import nn


def launch_with_background(
    plan: Plan, plan_path: Path, *, nproc: int, config: RunConfig, background: BackgroundConfig | None,
    worker_args: list[str], nodes: Nodes = Nodes(), checked: bool = False,
) -> None:
    """``deeppool run``'s launch of ``plan`` (loaded from, or saved to, ``plan_path``): the background checked
    first (unless ``checked`` already), MPS around the ranks when asked for."""
    if background is not None and not checked:
        preflight.check(plan, background)
    daemon: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if background is not None and background.mode is MuxMode.MPS:
        from deeppool.device.cuda import CudaGpu

        daemon = CudaGpu().mps_daemon()
    with daemon:
        launch(plan, plan_path, nproc=nproc, config=config, worker_args=worker_args + background_args(background),
               nodes=nodes)


def run(
    plan: Plan | Path | str, *, model: nn.Module | None = None, background: BackgroundConfig | None = None,
    config: RunConfig | None = None, nproc: int | None = None, data: str | None = None, checked: bool = False,
) -> dict[str, Any]:
    """Train ``plan`` on local ranks (with ``background`` in its idle windows); returns ``summary.json``.

    ``model`` is the module itself, for a plan made from Python (``deeppool.plan(module, ...)``): it is
    saved next to the run's copy of the plan, and every rank loads it from there. ``data`` is a
    ``package.module:factory`` (or ``file.py:factory``) returning a map-style ``Dataset``, as ``--data``:
    every rank builds it and loads only its rows (``config.data`` for its seed and workers). ``checked``: the
    background passed :func:`deeppool.multiplex.preflight.check` already.
    """
    config = config or RunConfig(out_dir=Path(tempfile.mkdtemp(prefix="deeppool-run-")))
    if data is not None:
        config = dataclasses.replace(config, data=DataConfig(factory=data))
    if config.out_dir is None:
        config = dataclasses.replace(config, out_dir=Path(tempfile.mkdtemp(prefix="deeppool-run-")))
    assert config.out_dir is not None
    loaded = plan if isinstance(plan, Plan) else Plan.load(plan)
    if model is not None:
        loaded = dataclasses.replace(loaded, model=_saved(model, loaded.model, config.out_dir))
    if loaded.model.source is ModelSource.PYTHON:
        raise DeeppoolError(f"the plan's model '{loaded.model.location}' was built in Python: "
                            "pass it as deeppool.run(plan, model=module)")
    if isinstance(plan, Plan) or model is not None:
        path = config.out_dir / "plan.json"
        loaded.save(path)
    else:
        path = Path(plan)
    launch_with_background(loaded, path, nproc=nproc or loaded.gpus, config=config, background=background,
                           worker_args=config_args(config), checked=checked)
    return json.loads((config.out_dir / "summary.json").read_text())


def _saved(module: nn.Module, planned: ModelSpec, out: Path) -> ModelSpec:
    """``module`` pickled into ``out`` for the ranks, with the inputs the plan was made with."""
    import torch

    cls = type(module)
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        where = "a function" if "<locals>" in cls.__qualname__ else "__main__"
        raise DeeppoolError(
            f"model class {cls.__qualname__} is defined in {where}, so the ranks cannot import it: "
            "define it in a module (a .py file next to your script) or give a model file"
        )
    if planned.source is ModelSource.FILE or not planned.input_shape:
        raise DeeppoolError("model= needs a plan made from Python with one input tensor: "
                            "for a model file, run `deeppool run PLAN --model model.py`")
    out.mkdir(parents=True, exist_ok=True)
    path = out / "model.pt"
    torch.save(module, path)
    return dataclasses.replace(planned, source=ModelSource.SAVED, location=str(path.resolve()), root=os.getcwd())
