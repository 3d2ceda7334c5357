"""How to build a model, its inputs, targets and loss: the model-file convention.

A *model file* is a Python file that defines::

    def model() -> nn.Module                                  # required
    def inputs(batch_size: int) -> tuple[Tensor, ...]         # required
    def targets(batch_size: int) -> Tensor                    # optional
    def loss(output: Tensor, targets: Tensor | None) -> Tensor  # optional, mean over samples

A *factory* is ``package.module:callable`` returning an ``nn.Module``,
importable from the environment or, as with ``python -m``, from the current
directory; its inputs are standard-normal tensors of ``input_shape`` per sample. Without
``loss`` the loss is the mean of the squared output. The :class:`ModelSpec`
is stored in every Plan so that other processes can rebuild the same model.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import nn

from deeppool.errors import DeeppoolError
from deeppool.planner.jsonio import field


class ModelSource(enum.Enum):
    FILE = "file"
    FACTORY = "factory"


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Where a model comes from; enough for any process to rebuild it."""

    source: ModelSource
    location: str
    input_shape: tuple[int, ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.source is ModelSource.FACTORY and not self.input_shape:
            raise DeeppoolError(
                f"model '{self.location}' is a factory: give its per-sample input shape, "
                "e.g. --input-shape 3,224,224"
            )
        if any(dim < 1 for dim in self.input_shape):
            raise DeeppoolError(f"--input-shape {self.input_shape} has a dimension < 1")

    @classmethod
    def parse(cls, text: str, *, input_shape: tuple[int, ...] = (), seed: int = 0) -> ModelSpec:
        """A path to a ``.py`` file, or ``package.module:callable``."""
        if text.endswith(".py") or Path(text).exists():
            path = Path(text)
            if not path.is_file():
                raise DeeppoolError(f"model file '{text}' does not exist: check the path")
            return cls(source=ModelSource.FILE, location=str(path.resolve()), seed=seed)
        if ":" not in text:
            raise DeeppoolError(
                f"model '{text}' is neither a .py file nor 'package.module:callable'"
            )
        return cls(
            source=ModelSource.FACTORY, location=text, input_shape=input_shape, seed=seed
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source.value,
            "location": self.location,
            "input_shape": list(self.input_shape),
            "seed": self.seed,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelSpec:
        try:
            source = ModelSource(field(data, "source", kind="model"))
        except ValueError:
            raise DeeppoolError(f"model source {data.get('source')!r} is unknown") from None
        return cls(
            source=source,
            location=str(field(data, "location", kind="model")),
            input_shape=tuple(int(d) for d in data.get("input_shape", [])),
            seed=int(data.get("seed", 0)),
        )

    def load(self, *, meta: bool = False) -> LoadedModel:
        """Build the model (parameters seeded with ``seed``) and its data functions.

        ``meta=True`` builds it on the meta device: shapes without storage or
        initialisation, all that tracing for a device model needs.
        """
        with torch.device("meta") if meta else contextlib.nullcontext():
            if self.source is ModelSource.FILE:
                return _load_file(self)
            return _load_factory(self)


@dataclass(frozen=True)
class LoadedModel:
    """A built model and the functions that make its synthetic data and loss."""

    module: nn.Module
    inputs: Callable[[int], tuple[torch.Tensor, ...]]
    targets: Callable[[int], torch.Tensor | None]
    loss: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def squared_mean_loss(output: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
    """The default loss: mean over samples of the squared output."""
    del targets
    return output.float().square().mean()


def _no_targets(batch_size: int) -> None:
    del batch_size


def _load_file(spec: ModelSpec) -> LoadedModel:
    module = _import_file(Path(spec.location))
    for required in ("model", "inputs"):
        if not callable(getattr(module, required, None)):
            raise DeeppoolError(
                f"model file '{spec.location}' defines no {required}() function: "
                "a model file must define model() and inputs(batch_size)"
            )
    torch.manual_seed(spec.seed)
    model = _build(module.model, spec.location)
    return LoadedModel(
        module=model,
        inputs=module.inputs,
        targets=getattr(module, "targets", _no_targets),
        loss=getattr(module, "loss", squared_mean_loss),
    )


def _import_file(path: Path) -> ModuleType:
    name = f"deeppool_model_{abs(hash(str(path)))}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise DeeppoolError(f"model file '{path}' cannot be imported as Python")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:  # the user's file raised while importing
        raise DeeppoolError(f"model file '{path}' failed to import: {type(err).__name__}: {err}") from None
    return module


@contextlib.contextmanager
def _importable_from_cwd() -> Iterator[None]:
    """Resolve ``package.module`` against the current directory too, as ``python -m`` does."""
    here = os.getcwd()
    added = here not in sys.path
    if added:
        sys.path.insert(0, here)
    try:
        yield
    finally:
        if added:
            sys.path.remove(here)


def _load_factory(spec: ModelSpec) -> LoadedModel:
    module_name, _, attr = spec.location.partition(":")
    try:
        with _importable_from_cwd():
            module = importlib.import_module(module_name)
    except ImportError as err:
        raise DeeppoolError(f"cannot import '{module_name}' for model '{spec.location}': {err}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise DeeppoolError(f"'{module_name}' has no callable '{attr}': check the model path")
    torch.manual_seed(spec.seed)
    model = _build(factory, spec.location)
    shape = spec.input_shape

    def make_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(spec.seed)
        return (torch.randn((batch_size, *shape), generator=generator),)

    return LoadedModel(module=model, inputs=make_inputs, targets=_no_targets, loss=squared_mean_loss)


def _build(factory: Callable[[], Any], where: str) -> nn.Module:
    try:
        model = factory()
    except Exception as err:
        raise DeeppoolError(f"building model '{where}' failed: {type(err).__name__}: {err}") from None
    if not isinstance(model, nn.Module):
        raise DeeppoolError(f"model '{where}' returned {type(model).__name__}, not an nn.Module")
    return model
