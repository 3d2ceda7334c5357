"""Checkpoints: each layer group writes its own shard; a checkpoint counts once every file is written.

A plan's *layer group* ``g`` is its layers on ``g`` GPUs. Ranks ``0..g-1`` run
them and hold them alike: the same parameters, the same gradients after the
group's all-reduce, so the same optimizer state, and the same synchronised
BatchNorm statistics. So a checkpoint stores each group once:

* ``<dir>/step-<N>/group<g>.pt`` — the group's parameters and buffers (by
  their names in the user's model) and their optimizer state (by parameter
  name), written by rank ``g-1``: each group has its own writer, and the
  groups are written at once;
* ``<dir>/step-<N>/rank<r>.pt`` — with ``--batchnorm local`` only: rank
  ``r``'s BatchNorm running statistics, which differ between the ranks of a
  group (each normalises by its own samples); :func:`export` takes rank 0's,
  as DDP keeps rank 0's buffers;
* ``<dir>/step-<N>/kfac<r>.pt`` — with ``--optimizer kfac`` only: rank ``r``'s K-FAC state (the
  factors of the layers it runs, the eigendecompositions it owns);
* ``<dir>/step-<N>/run.pt`` — what every rank has alike: ``N`` (optimizer
  steps done), the optimizer's hyperparameters, the LR schedule's state, the
  fp16 loss scale and its growth count (``--precision fp16``; every rank
  agrees on it), the noise scale's moving averages and AdaScale's τ, and
  the data position: the global batches consumed (with ``--data``, epoch
  ``⌊n / N_e⌋``, batch ``n mod N_e`` of
  :class:`~deeppool.executor.engine.data.EpochOrder`); written by rank 0.

Per-sample random draws are seeded by the step, so a resumed run continues
exactly where the interrupted one was. Every file is written to a
temporary file, synced and renamed into place; after every rank has written
(a barrier), rank 0 writes ``COMPLETE`` naming the groups. A rank killed
mid-write leaves no ``COMPLETE`` in that step's directory, so :func:`latest`
still finds the previous checkpoint. :func:`export` joins the groups into one
``state_dict`` of the user's unsplit model.

A complete checkpoint can still be damaged later (a disk that lost a file's
tail, a copy cut short). :func:`intact` checks every file of the newest
complete checkpoints (each is a zip archive whose members carry CRCs) and
returns the newest whose files all read back whole, naming each damaged
shard it passed over; ``--resume`` and ``deeppool export`` fall back to it
and say so. A shard that still fails to load is one error naming it.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deeppool.errors import DeeppoolError

MARKER = "COMPLETE"
RUN_FILE = "run.pt"


@dataclass(frozen=True, kw_only=True)
class GroupShard:
    """One layer group's part of a checkpoint: what its ranks hold alike."""

    gpus: int
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    optimizer: dict[str, dict[str, Any]]
    """Each parameter's optimizer state (momentum, Adam's moments and step), by parameter name."""

    def to_dict(self) -> dict[str, Any]:
        return {"gpus": self.gpus, "params": self.params, "buffers": self.buffers, "optimizer": self.optimizer}


@dataclass(frozen=True, kw_only=True)
class RunState:
    """What every rank has alike: the steps done, the optimizer's hyperparameters, the schedule."""

    steps_done: int
    optimizer_groups: list[dict[str, Any]] | None
    """The optimizer's ``param_groups`` without their parameters (learning rate, momentum...)."""
    scheduler: dict[str, Any] | None
    model_keys: dict[str, str]
    """Each key of the user's model's ``state_dict`` and the name its tensor is stored under
    (tied weights are stored once; tensors tracing made up are stored but not exported)."""
    progress: dict[str, Any]
    """The data position (global batches consumed) and what a policy may have changed, accumulation and
    base LR (:class:`~deeppool.executor.training.adapt.Progress`)."""
    scaler: dict[str, Any] | None = None
    """The fp16 loss scaler's state (:class:`~deeppool.executor.engine.precision.AgreedScaler`)."""
    adaptation: dict[str, Any] | None = None
    """The noise scale's moving averages (rank 0's, which writes this file) and AdaScale's τ and gain
    (``--monitor gns``, ``--lr-scaling adascale``)."""

    def to_dict(self) -> dict[str, Any]:
        return {"steps_done": self.steps_done, "optimizer_groups": self.optimizer_groups, "scheduler": self.scheduler,
                "model_keys": self.model_keys, "progress": self.progress, "scaler": self.scaler,
                "adaptation": self.adaptation}


def model_keys(model: torch.nn.Module) -> dict[str, str]:
    """For each key of ``model.state_dict()``, the first name of its tensor (the name a rank holds it by)."""
    first: dict[int, str] = {}
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        first.setdefault(id(tensor), name)
    return {key: first.get(id(tensor), key) for key, tensor in model.state_dict(keep_vars=True).items()}


def step_dir(directory: Path, steps_done: int) -> Path:
    return directory / f"step-{steps_done:08d}"


def group_file(gpus: int) -> str:
    return f"group{gpus}.pt"


def own_file(rank: int) -> str:
    return f"rank{rank}.pt"


def load_own(directory: Path, steps_done: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s own buffers (``--batchnorm local``), empty when the checkpoint has none."""
    path = step_dir(directory, steps_done) / own_file(rank)
    return torch.load(path, map_location="cpu") if path.is_file() else {}


def kfac_file(rank: int) -> str:
    return f"kfac{rank}.pt"


def load_kfac(directory: Path, steps_done: int, rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s K-FAC state (``--optimizer kfac``), None when the checkpoint has none."""
    path = step_dir(directory, steps_done) / kfac_file(rank)
    return torch.load(path, map_location="cpu") if path.is_file() else None


def writer(gpus: int) -> int:
    """The rank that writes group ``gpus``: its last, so every group has its own."""
    return gpus - 1


def save(
    directory: Path, rank: int, run: RunState, shard: GroupShard | None, groups: tuple[int, ...],
    barrier: Callable[[], None], own: dict[str, torch.Tensor] | None = None, kfac: dict[str, Any] | None = None,
) -> Path:
    """Write this rank's files atomically; after ``barrier`` (every rank has written) rank 0 marks the step complete.

    ``own``: buffers that differ between the ranks of a group (``--batchnorm local``'s running
    statistics), written by every rank to ``rank<r>.pt``. ``kfac``: the rank's K-FAC state (its layers' factors
    and the eigendecompositions it owns), written by every rank to ``kfac<r>.pt``."""
    target = step_dir(directory, run.steps_done)
    target.mkdir(parents=True, exist_ok=True)
    if shard is not None:
        _atomic(target / group_file(shard.gpus), lambda path: torch.save(shard.to_dict(), path))
    if own:
        _atomic(target / own_file(rank), lambda path: torch.save(own, path))
    if kfac is not None:
        _atomic(target / kfac_file(rank), lambda path: torch.save(kfac, path))
    if rank == 0:
        _atomic(target / RUN_FILE, lambda path: torch.save(run.to_dict(), path))
    barrier()
    if rank == 0:
        marker = json.dumps({"steps_done": run.steps_done, "groups": sorted(groups)})
        _atomic(target / MARKER, lambda path: path.write_text(marker + "\n"))
    return target


def latest(directory: Path) -> int | None:
    """The steps done by the newest complete checkpoint, or None."""
    done = [int(path.parent.name.split("-")[1]) for path in directory.glob(f"step-*/{MARKER}")]
    return max(done, default=None)


def damage(directory: Path, steps_done: int) -> str | None:
    """What is wrong with a complete checkpoint's files (the first damaged one, named), or None if all are whole."""
    step = step_dir(directory, steps_done)
    try:
        names = [RUN_FILE, *(group_file(g) for g in groups(directory, steps_done)),
                 *sorted(path.name for path in step.glob("rank*.pt"))]
    except DeeppoolError as err:
        return str(err)
    for name in names:
        path = step / name
        try:
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
        except FileNotFoundError:
            return f"shard '{path}' is missing"
        except (OSError, zipfile.BadZipFile, EOFError, ValueError) as err:
            return f"shard '{path}' is damaged ({err})"
        if bad is not None:
            return f"shard '{path}' is damaged (its part '{bad}' fails its checksum)"
    return None


def intact(directory: Path, warn: Callable[[str], None]) -> int | None:
    """The steps done by the newest complete checkpoint whose files are all whole, or None; ``warn`` is told
    of each newer one passed over, and which is used instead."""
    done = sorted((int(path.parent.name.split("-")[1]) for path in directory.glob(f"step-*/{MARKER}")), reverse=True)
    for position, steps in enumerate(done):
        problem = damage(directory, steps)
        if problem is None:
            return steps
        fallback = f"the one after {done[position + 1]} steps" if position + 1 < len(done) else "none is left"
        warn(f"the checkpoint after {steps} steps is damaged: {problem}; falling back to the newest intact "
             f"checkpoint ({fallback})")
    return None


def load_run(directory: Path, steps_done: int) -> RunState:
    return RunState(**_load(step_dir(directory, steps_done) / RUN_FILE))


def load_group(directory: Path, steps_done: int, gpus: int) -> GroupShard:
    return GroupShard(**_load(step_dir(directory, steps_done) / group_file(gpus)))


def groups(directory: Path, steps_done: int) -> tuple[int, ...]:
    """The layer groups a complete checkpoint holds, from its ``COMPLETE`` marker."""
    marker = step_dir(directory, steps_done) / MARKER
    try:
        return tuple(int(g) for g in json.loads(marker.read_text())["groups"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DeeppoolError(f"checkpoint marker '{marker}' is unreadable ({err}): use another checkpoint") from None


def export(directory: Path, steps_done: int | None = None, warn: Callable[[str], None] = lambda message: None
           ) -> tuple[int, dict[str, torch.Tensor]]:
    """One ``state_dict`` of the whole model from a complete checkpoint: ``steps_done``'s, or the newest intact
    one (``warn`` names each damaged newer one passed over)."""
    if not directory.is_dir():
        raise DeeppoolError(f"checkpoint directory '{directory}' does not exist: pass the run's --checkpoint-dir")
    done = intact(directory, warn) if steps_done is None else steps_done
    if done is None:
        damaged = " intact" if latest(directory) is not None else ""
        raise DeeppoolError(f"'{directory}' holds no{damaged} complete checkpoint: train with --checkpoint-every N "
                            "first")
    if not (step_dir(directory, done) / MARKER).is_file():
        raise DeeppoolError(f"'{directory}' has no complete checkpoint after {done} steps: "
                            f"the newest is after {latest(directory)}")
    stored: dict[str, torch.Tensor] = {}
    for gpus in groups(directory, done):
        shard = load_group(directory, done, gpus)
        stored.update(shard.params)
        stored.update(shard.buffers)
    stored.update(load_own(directory, done, 0))  # per-rank statistics: rank 0's, as DDP keeps
    keys = load_run(directory, done).model_keys
    lost = [key for key, name in keys.items() if name not in stored]
    if lost:
        raise DeeppoolError(f"checkpoint '{step_dir(directory, done)}' has no tensor for '{lost[0]}': "
                            "a layer group's shard is missing; use another checkpoint")
    return done, {key: stored[name] for key, name in keys.items()}


def _load(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise DeeppoolError(f"checkpoint '{path.parent}' has no '{path.name}': was it written by this plan?")
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001: torch raises anything from EOFError to UnpicklingError for a bad file
        raise DeeppoolError(f"checkpoint shard '{path}' is damaged ({type(err).__name__}: {str(err)[:200]}): "
                            "use an earlier checkpoint (export --step N)") from None


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    write(temporary)
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, path)
