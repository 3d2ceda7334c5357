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

from deeppool.errors import DeeppoolError
from deeppool.executor.config import DataConfig, Nodes, RunConfig
from deeppool.executor.launch.cli import check_ranks
from deeppool.executor.launch.launch import launch
from deeppool.multiplex import preflight
from deeppool.multiplex.config import BACKGROUND_KEY, BackgroundConfig, MuxMode
from deeppool.multiplex.guests import GUESTS_KEY, GuestsConfig
from deeppool.plans import ModelSource, ModelSpec, Plan

if TYPE_CHECKING:
    from torch import nn


def launch_with_background(
    plan: Plan, plan_path: Path, *, nproc: int, config: RunConfig, background: BackgroundConfig | None,
    nodes: Nodes = Nodes(), checked: bool = False, guests: GuestsConfig | None = None,
) -> None:
    """``deeppool run``'s launch of ``plan`` (loaded from, or saved to, ``plan_path``): the background checked
    first (unless ``checked`` already), MPS around the ranks when asked for; the ranks find the background in
    their config file. ``guests`` (without a ``background``): the ranks take in the guests a coordinator lends
    the running job (:mod:`deeppool.multiplex.guests`)."""
    if background is not None and not checked:
        preflight.check(plan, background)
    daemon: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if background is not None and background.mode is MuxMode.MPS:
        from deeppool.device.cuda import CudaGpu

        daemon = CudaGpu().mps_daemon()
    with daemon:
        extra = {BACKGROUND_KEY: background.to_json()} if background is not None else \
            {GUESTS_KEY: guests.to_json()} if guests is not None else None
        launch(plan, plan_path, nproc=nproc, config=config, nodes=nodes, extra=extra)


def run(
    plan: Plan | Path | str, *, model: nn.Module | None = None, background: BackgroundConfig | None = None,
    config: RunConfig | None = None, nproc: int | None = None, data: str | None = None, checked: bool = False,
    plan_path: Path | None = None, guests: GuestsConfig | None = None,
) -> dict[str, Any]:
    """Train ``plan`` on local ranks (with ``background`` in its idle windows); returns ``summary.json``.

    ``nproc`` (default: the plan's GPU count) must match the plan and fit this machine, as ``deeppool run``
    checks (:func:`~deeppool.executor.launch.cli.check_ranks`: one rank per CUDA GPU, else at most four gloo
    ranks per CPU core); a plan for more is refused before anything starts.

    ``model`` is the module itself, for a plan made from Python (``deeppool.plan(module, ...)``): it is
    saved next to the run's copy of the plan, and every rank loads it from there, with random inputs of the
    plan's input shape and no targets. Its loss is :func:`deeppool.model.loading.default_loss`: the
    module's own loss when its output carries one (``output.loss``, ``output["loss"]``, or a scalar first
    item), else the mean square of its floating outputs — a stand-in that exercises every layer, not a
    training objective. For a real loss and targets, give a model file that defines ``loss`` and ``targets``
    (``deeppool run plan.json --model model.py``) or train in your own loop with
    :func:`deeppool.parallelize`. ``data`` is a
    ``package.module:factory`` (or ``file.py:factory``) returning a map-style ``Dataset``, as ``--data``:
    every rank builds it and loads only its rows (``config.data`` for its seed and workers). ``checked``: the
    background passed :func:`deeppool.multiplex.preflight.check` already. ``plan_path``: the file a ``Plan``
    given in memory is saved in already, which the ranks then read (else it is saved into the run's folder).
    ``guests``: the control file of a coordinator's guests that join the running job
    (:mod:`deeppool.multiplex.guests`; used only without ``background``).
    """
    loaded = plan if isinstance(plan, Plan) else Plan.load(plan)
    check_ranks(nproc if nproc is not None else loaded.gpus, loaded, given=nproc is not None)
    config = config or RunConfig(out_dir=Path(tempfile.mkdtemp(prefix="deeppool-run-")))
    if data is not None:
        config = dataclasses.replace(config, data=DataConfig(factory=data))
    if config.out_dir is None:
        config = dataclasses.replace(config, out_dir=Path(tempfile.mkdtemp(prefix="deeppool-run-")))
    assert config.out_dir is not None
    if model is not None:
        loaded = dataclasses.replace(loaded, model=_saved(model, loaded.model, config.out_dir))
    if loaded.model.source is ModelSource.PYTHON:
        raise DeeppoolError(f"the plan's model '{loaded.model.location}' was built in Python: "
                            "pass it as deeppool.run(plan, model=module)")
    if isinstance(plan, Plan) and plan_path is not None and model is None:
        path = plan_path
    elif isinstance(plan, Plan) or model is not None:
        path = config.out_dir / "plan.json"
        loaded.save(path)
    else:
        path = Path(plan)
    launch_with_background(loaded, path, nproc=nproc or loaded.gpus, config=config, background=background,
                           checked=checked, guests=guests)
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
