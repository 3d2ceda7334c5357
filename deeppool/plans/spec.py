"""Where a model comes from: enough for any process to rebuild it (:func:`deeppool.model.loading.load_model`)."""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deeppool.errors import DeeppoolError
from deeppool.plans.jsonio import field

if TYPE_CHECKING:
    import torch

FLOAT_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64", "half", "float", "double"})
INTEGER_DTYPES = frozenset({"int8", "int16", "int32", "int64", "uint8", "long", "int"})


class ModelSource(enum.Enum):
    FILE = "file"
    FACTORY = "factory"
    SAVED = "saved"
    """A module pickled with ``torch.save`` (``deeppool.run(plan, model=module)`` writes one)."""
    PYTHON = "python"
    """A module built in a Python session that no other process can rebuild: run it with its module."""


REBUILD_HINT = (
    "run it with deeppool.run(plan, model=module) or `deeppool run PLAN --model model.py`, "
    "or plan it with deeppool.plan(..., model_spec=ModelSpec.parse('model.py'))"
)


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Where a model comes from; enough for any process to rebuild it."""

    source: ModelSource
    location: str
    input_shape: tuple[int, ...] = ()
    input_dtype: str = "float32"
    vocab_size: int = 0
    seed: int = 0
    root: str = ""
    """A factory's import folder (the current one when it was planned); '' imports from the current folder."""
    function: str = "model"
    """A model file's function that builds the module (``model.py:build`` names ``build``)."""

    def __post_init__(self) -> None:
        if self.source in (ModelSource.FACTORY, ModelSource.SAVED) and not self.input_shape:
            raise DeeppoolError(
                f"model '{self.location}' is a factory: give its per-sample input shape, "
                "e.g. --input-shape 3,224,224 (or --input-shape 128 --input-dtype int64 --vocab-size 50257)"
            )
        if any(dim < 1 for dim in self.input_shape):
            raise DeeppoolError(f"--input-shape {self.input_shape} has a dimension < 1")
        if self.input_dtype not in FLOAT_DTYPES | INTEGER_DTYPES:
            raise DeeppoolError(f"--input-dtype '{self.input_dtype}' is not a torch dtype, e.g. float32 or int64")
        if self.input_dtype in INTEGER_DTYPES and self.vocab_size < 1:
            raise DeeppoolError(
                f"--input-dtype {self.input_dtype} gives token ids: also give --vocab-size (ids are drawn below it)"
            )

    @property
    def dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.input_dtype)

    @classmethod
    def parse(
        cls, text: str, *, input_shape: tuple[int, ...] = (), input_dtype: str = "float32", vocab_size: int = 0,
        seed: int = 0,
    ) -> ModelSpec:
        """A path to a ``.py`` file (``model.py``, or ``model.py:build`` for another function than ``model``),
        or ``package.module:callable``."""
        file, function = _file_and_function(text)
        if file.endswith(".py") or Path(file).exists():
            path = Path(file)
            if not path.is_file():
                raise DeeppoolError(f"model file '{file}' does not exist: check the path")
            _no_factory_options(text, input_shape=input_shape, input_dtype=input_dtype, vocab_size=vocab_size)
            return cls(source=ModelSource.FILE, location=str(path.resolve()), seed=seed, function=function)
        if ":" not in text:
            raise DeeppoolError(
                f"model '{text}' is neither a .py file nor 'package.module:callable'"
            )
        return cls(
            source=ModelSource.FACTORY, location=text, input_shape=input_shape, input_dtype=input_dtype,
            vocab_size=vocab_size, seed=seed, root=os.getcwd(),
        )

    def to_json(self, *, base: Path | None = None) -> dict[str, Any]:
        """The JSON form; with ``base`` (the plan file's folder) paths are written relative to it."""
        return {
            "source": self.source.value,
            "location": _relative(self.location, base) if self.source in _PATH_SOURCES else self.location,
            "input_shape": list(self.input_shape),
            "input_dtype": self.input_dtype,
            "vocab_size": self.vocab_size,
            "seed": self.seed,
            "root": _relative(self.root, base) if self.root else "",
        } | ({"function": self.function} if self.function != "model" else {})

    @classmethod
    def from_json(cls, data: dict[str, Any], *, base: Path | None = None) -> ModelSpec:
        """Read the JSON form; relative paths are resolved against ``base`` (the plan file's folder)."""
        try:
            source = ModelSource(field(data, "source", kind="model"))
        except ValueError:
            raise DeeppoolError(f"model source {data.get('source')!r} is unknown") from None
        location = str(field(data, "location", kind="model"))
        root = str(data.get("root", ""))
        return cls(
            source=source,
            location=_absolute(location, base) if source in _PATH_SOURCES else location,
            input_shape=tuple(int(d) for d in data.get("input_shape", [])),
            input_dtype=str(data.get("input_dtype", "float32")),
            vocab_size=int(data.get("vocab_size", 0)),
            seed=int(data.get("seed", 0)),
            root=_absolute(root, base) if root else "",
            function=str(data.get("function", "model")),
        )


_PATH_SOURCES = (ModelSource.FILE, ModelSource.SAVED)


def _relative(path: str, base: Path | None) -> str:
    return path if base is None else os.path.relpath(path, base)


def _absolute(path: str, base: Path | None) -> str:
    return path if base is None else os.path.normpath(base / path)


def _file_and_function(text: str) -> tuple[str, str]:
    """``model.py:build`` as (``model.py``, ``build``); any other text as (text, ``model``)."""
    file, colon, function = text.rpartition(":")
    if colon and file.endswith(".py") and function.isidentifier():
        return file, function
    return text, "model"


def _no_factory_options(text: str, *, input_shape: tuple[int, ...], input_dtype: str, vocab_size: int) -> None:
    given = [flag for flag, used in (("--input-shape", bool(input_shape)), ("--input-dtype", input_dtype != "float32"),
                                     ("--vocab-size", bool(vocab_size))) if used]
    if given:
        raise DeeppoolError(
            f"{given[0]} is for a factory (package.module:callable): model file '{text}' makes its own "
            "inputs with inputs(batch_size); drop the flag or change inputs()"
        )
