"""How to build a model, its inputs, targets and loss: the model-file convention.

A *model file* is a Python file that defines::

    def model() -> nn.Module                       # required (``file.py:build`` names another function)
    def inputs(batch_size: int) -> tuple[Tensor, ...] | dict[str, Any]  # required: forward's args
    def targets(batch_size: int) -> Tensor                          # optional
    def loss(output: Any, targets: Tensor | None) -> Tensor         # optional, mean over samples

``inputs`` returns the positional arguments of ``forward`` or a dict of its
keyword arguments (``input_ids``, ``attention_mask``, ``labels``...); every
tensor has the batch in dimension 0, other values (``use_cache=False``) are
constants. Both are bound to ``forward``'s signature by name
(:func:`bind_inputs`); a ``forward`` that takes ``use_cache`` (Hugging Face
decoders) gets ``use_cache=False`` unless ``inputs()`` says otherwise, since
training uses no generation cache and a cache object is no tensor structure. ``output`` is whatever the model returns: a tensor,
tuple, namedtuple, dict or ``ModelOutput``. Without ``loss`` the loss is
:func:`default_loss`: the model's own loss when it returns one (Hugging Face
models given ``labels``), else the mean of the squared floating outputs.

A *factory* is ``package.module:callable`` returning an ``nn.Module``,
importable from the environment or, as with ``python -m``, from the folder it
was planned in (``root``); its one input has ``input_shape`` per sample:
standard normal, or for an integer ``input_dtype`` token ids below
``vocab_size``. A *saved* model is a module pickled by ``deeppool.run(plan,
model=module)``, with a factory's inputs; a *python* model was built in a
Python session and cannot be rebuilt. The :class:`ModelSpec` is stored in
every Plan so that other processes can rebuild the same model; a Plan file
stores its paths relative to itself.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from deeppool.errors import DeeppoolError
from deeppool.plans.spec import REBUILD_HINT, ModelSource, ModelSpec

if TYPE_CHECKING:  # torch loads only when a model is built: the CLI checks options without it
    import torch
    from torch import nn


Inputs = "tuple[torch.Tensor, ...] | Mapping[str, Any]"
"""What ``inputs(batch_size)`` returns: ``forward``'s positional or keyword arguments."""


@dataclass(frozen=True)
class LoadedModel:
    """A built model and the functions that make its synthetic data and loss."""

    module: nn.Module
    inputs: Callable[[int], Inputs]
    targets: Callable[[int], torch.Tensor | None]
    loss: Callable[[Any, torch.Tensor | None], torch.Tensor]

    def named_inputs(self, batch_size: int) -> dict[str, Any]:
        """``inputs(batch_size)`` bound to ``forward``'s parameter names."""
        return bind_inputs(self.module, self.inputs(batch_size))


def load_model(spec: ModelSpec, *, meta: bool = False) -> LoadedModel:
    """Build ``spec``'s model (parameters seeded with its ``seed``) and its data functions.

    ``meta=True`` builds it on the meta device: shapes without storage or
    initialisation, all that tracing for a device model needs.
    """
    import torch

    if spec.source is ModelSource.PYTHON:
        raise DeeppoolError(f"the plan's model '{spec.location}' was built in Python and cannot be rebuilt: "
                            + REBUILD_HINT)
    with torch.device("meta") if meta else contextlib.nullcontext():
        if spec.source is ModelSource.FILE:
            return _load_file(spec)
        if spec.source is ModelSource.SAVED:
            return _load_saved(spec)
        return _load_factory(spec)



def bind_inputs(module: nn.Module, given: Any) -> dict[str, Any]:
    """Name every value of ``given`` (a tensor, tuple or dict) by ``module.forward``'s parameters."""
    import torch

    signature = inspect.signature(module.forward)
    if isinstance(given, torch.Tensor):
        given = (given,)
    try:
        if isinstance(given, Mapping):
            bound = signature.bind(**given)
        elif isinstance(given, (tuple, list)):
            bound = signature.bind(*given)
        else:
            raise TypeError(f"got {type(given).__name__}, not a tuple or dict")
    except TypeError as err:
        raise DeeppoolError(
            f"inputs() does not fit {type(module).__name__}.forward{signature}: {err}"
        ) from None
    named = dict(bound.arguments)
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL and name in named:
            raise DeeppoolError(
                f"{type(module).__name__}.forward takes *{name}: give inputs() as a dict of named arguments"
            )
        if parameter.kind is inspect.Parameter.VAR_KEYWORD and name in named:
            named.update(named.pop(name))
    if "use_cache" in signature.parameters:
        named.setdefault("use_cache", False)
    return named


def default_loss(output: Any, targets: torch.Tensor | None) -> torch.Tensor:
    """The model's own loss when it returns one, else the mean of its squared outputs.

    The own loss is ``output.loss`` or ``output["loss"]`` (a ``ModelOutput`` or
    dict, as Hugging Face models return when given ``labels``) or the first
    item of a tuple when that is a scalar. Otherwise it is the sum over the
    output's floating tensors of their mean square: every head trains.
    """
    import torch
    from torch.utils import _pytree as pytree

    del targets
    own = _own_loss(output)
    if own is not None:
        return own
    leaves = [
        leaf for leaf in pytree.tree_leaves(output)
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.dim() > 0
    ]
    if not leaves:
        raise DeeppoolError("the model returns no floating tensor to train on: define loss(output, targets)")
    return sum((leaf.float().square().mean() for leaf in leaves[1:]), leaves[0].float().square().mean())


def _own_loss(output: Any) -> torch.Tensor | None:
    import torch

    found = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if found is None and isinstance(output, (tuple, list)) and output:
        found = output[0]
    return found if isinstance(found, torch.Tensor) and found.dim() == 0 else None


def _no_targets(batch_size: int) -> None:
    del batch_size


def _load_file(spec: ModelSpec) -> LoadedModel:
    module = _import_file(Path(spec.location))
    for required in (spec.function, "inputs"):
        if not callable(getattr(module, required, None)):
            raise DeeppoolError(
                f"model file '{spec.location}' defines no {required}() function: "
                f"a model file must define {spec.function}() and inputs(batch_size)"
            )
    import torch

    torch.manual_seed(spec.seed)
    model = _build(getattr(module, spec.function), spec.location)
    return LoadedModel(
        module=model,
        inputs=_tupled(module.inputs),
        targets=getattr(module, "targets", _no_targets),
        loss=getattr(module, "loss", default_loss),
    )


def _tupled(inputs: Callable[[int], Any]) -> Callable[[int], Any]:
    """``inputs`` with a bare tensor returned as the one positional argument it is."""
    import torch

    def make(batch_size: int) -> Any:
        given = inputs(batch_size)
        return (given,) if isinstance(given, torch.Tensor) else given

    return make


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
def importable_from(root: str) -> Iterator[None]:
    """Resolve ``package.module`` against ``root`` (default: the current folder) too, as ``python -m`` does."""
    here = root or os.getcwd()
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
        with importable_from(spec.root):
            module = importlib.import_module(module_name)
    except ImportError as err:
        raise DeeppoolError(f"cannot import '{module_name}' for model '{spec.location}': {err}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise DeeppoolError(f"'{module_name}' has no callable '{attr}': check the model path")
    import torch

    torch.manual_seed(spec.seed)
    return LoadedModel(module=_build(factory, spec.location), inputs=_shaped_inputs(spec), targets=_no_targets,
                       loss=default_loss)


def _load_saved(spec: ModelSpec) -> LoadedModel:
    import torch

    path = Path(spec.location)
    if not path.is_file():
        raise DeeppoolError(f"saved model '{path}' does not exist: {REBUILD_HINT}")
    try:
        with importable_from(spec.root):
            module = torch.load(path, map_location="cpu", weights_only=False)
    except (AttributeError, ImportError, RuntimeError) as err:
        raise DeeppoolError(f"saved model '{path}' cannot be loaded here ({type(err).__name__}: {err}): "
                            "its class must be importable; or give a model file") from None
    return LoadedModel(module=_build(lambda: module, spec.location), inputs=_shaped_inputs(spec),
                       targets=_no_targets, loss=default_loss)


def _shaped_inputs(spec: ModelSpec) -> Callable[[int], tuple[torch.Tensor, ...]]:
    """One input of ``spec.input_shape`` per sample: standard normal, or token ids below ``vocab_size``."""
    import torch

    shape = (*spec.input_shape,)

    def make_inputs(batch_size: int) -> tuple[torch.Tensor, ...]:
        generator = torch.Generator().manual_seed(spec.seed)
        if spec.dtype.is_floating_point:
            return (torch.randn((batch_size, *shape), generator=generator, dtype=spec.dtype),)
        return (torch.randint(0, spec.vocab_size, (batch_size, *shape), generator=generator, dtype=spec.dtype),)

    return make_inputs


def _build(factory: Callable[[], Any], where: str) -> nn.Module:
    from torch import nn

    try:
        model = factory()
    except Exception as err:
        raise DeeppoolError(f"building model '{where}' failed: {type(err).__name__}: {err}") from None
    if not isinstance(model, nn.Module):
        raise DeeppoolError(f"model '{where}' returned {type(model).__name__}, not an nn.Module")
    return model
