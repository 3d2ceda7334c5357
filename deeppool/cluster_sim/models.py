"""Which model (and global batch) each trace job trains.

The batch of each job follows the batch rule of :mod:`deeppool.scheduling.choice`.

Traces name no models, so every job is mapped to a model file through its
workload key (the Pollux application, the Philly virtual-cluster id, the
synthetic job's class). Defaults (docs/simulator.md):

* Pollux applications: imagenet → resnet50, cifar10 → inception,
  yolov3 → vgg16, bert / deepspeech2 / ncf → gpt2 (the closest example in kind:
  ImageNet CNN, small CNN, detection backbone, sequence models).
* Philly ids and anything unlisted: one of the four examples, drawn per job
  from a generator seeded with ``--seed`` (Philly records no model).
* Synthetic jobs: the example their class names.

A mapping file (JSON) replaces the defaults::

    {"imagenet": {"model": "examples/resnet50.py", "global_batch": 256},
     "*":        {"model": "gpt2", "global_batch": 64}}

``model`` is an example name or a model-file path (relative to the mapping
file); ``"*"`` maps every key not listed. Without ``"*"`` an unlisted key is
an error that names it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import deeppool
from deeppool.errors import DeeppoolError
from deeppool.scheduling.choice import ModelChoice

EXAMPLES_DIR = Path(deeppool.__file__).resolve().parent.parent / "examples"
EXAMPLE_BATCH = {"vgg16": 128, "resnet50": 256, "inception": 256, "gpt2": 64}
REFERENCE_GPUS = 8
"""The examples' global batches are for 8 GPUs; their per-GPU batch is that over 8."""
POLLUX_DEFAULT = {
    "imagenet": "resnet50",
    "cifar10": "inception",
    "yolov3": "vgg16",
    "bert": "gpt2",
    "deepspeech2": "gpt2",
    "ncf": "gpt2",
}
WILDCARD = "*"


def example(name: str, global_batch: int | None = None) -> ModelChoice:
    path = EXAMPLES_DIR / f"{name}.py"
    if name not in EXAMPLE_BATCH or not path.is_file():
        raise DeeppoolError(f"'{name}' is not an example model: use one of {', '.join(EXAMPLE_BATCH)} or a .py path")
    per_gpu = None if global_batch else EXAMPLE_BATCH[name] // REFERENCE_GPUS
    return ModelChoice(name=name, path=path.resolve(), global_batch=global_batch or EXAMPLE_BATCH[name],
                       per_gpu_batch=per_gpu)


@dataclass(frozen=True, kw_only=True)
class ModelMapping:
    """Workload key → model; unlisted keys go to ``fallback``, else a seeded draw from ``spread``."""

    by_key: Mapping[str, ModelChoice] = field(default_factory=dict)
    fallback: ModelChoice | None = None
    spread: tuple[ModelChoice, ...] = ()
    source: str = "defaults"

    def resolve(self, key: str, rng: random.Random, *, where: str) -> ModelChoice:
        if key in self.by_key:
            return self.by_key[key]
        if self.fallback is not None:
            return self.fallback
        if self.spread:
            return rng.choice(self.spread)
        raise DeeppoolError(
            f"{where}: '{key}' has no model mapping in {self.source}: add it (or \"*\") to a --mapping file"
        )

    def choices(self) -> tuple[ModelChoice, ...]:
        listed = list(self.by_key.values()) + ([self.fallback] if self.fallback else []) + list(self.spread)
        return tuple({choice.name: choice for choice in listed}.values())


def default_mapping(*, spread: bool = True) -> ModelMapping:
    """The defaults; ``spread`` draws a model for unlisted keys (Philly ids), else they are errors (applications)."""
    examples = {name: example(name) for name in EXAMPLE_BATCH}
    by_key = {**examples, **{app: examples[model] for app, model in POLLUX_DEFAULT.items()}}
    source = "the default mapping" + ("" if spread else f" (applications: {', '.join(sorted(by_key))})")
    return ModelMapping(by_key=by_key, spread=tuple(examples.values()) if spread else (), source=source)


def load_mapping(path: str | Path) -> ModelMapping:
    source = Path(path)
    if not source.is_file():
        raise DeeppoolError(f"mapping file '{path}' does not exist: check the path")
    try:
        payload = json.loads(source.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DeeppoolError(f"mapping file '{path}' is not valid JSON ({err.__class__.__name__}: {err})") from None
    if not isinstance(payload, dict) or not payload:
        raise DeeppoolError(f"mapping file '{path}': expected a JSON object of key -> {{model, global_batch}}")
    entries = {str(key): _entry(source, str(key), value) for key, value in payload.items()}
    fallback = entries.pop(WILDCARD, None)
    return ModelMapping(by_key=entries, fallback=fallback, source=f"mapping file '{path}'")


def _entry(source: Path, key: str, value: Any) -> ModelChoice:
    if not isinstance(value, dict) or "model" not in value:
        raise DeeppoolError(f"mapping file '{source}': entry '{key}' needs a \"model\" (example name or .py path)")
    model = str(value["model"])
    batch, per_gpu = value.get("global_batch"), value.get("per_gpu_batch")
    trace_batch = value.get("trace_batch", False)
    if not isinstance(trace_batch, bool):
        raise DeeppoolError(f"mapping file '{source}': entry '{key}': trace_batch must be true or false")
    for field_name, number in (("global_batch", batch), ("per_gpu_batch", per_gpu)):
        if number is not None and (not isinstance(number, int) or number < 1):
            raise DeeppoolError(f"mapping file '{source}': entry '{key}': {field_name} must be an integer >= 1")
    if model in EXAMPLE_BATCH:
        chosen = example(model, batch)
        return replace(chosen, per_gpu_batch=per_gpu or chosen.per_gpu_batch, trace_batch=trace_batch)
    path = Path(model) if Path(model).is_absolute() else source.resolve().parent / model
    if not path.is_file():
        raise DeeppoolError(f"mapping file '{source}': entry '{key}': model file '{path}' does not exist")
    if batch is None and per_gpu is None:
        raise DeeppoolError(f"mapping file '{source}': entry '{key}': a model file needs a global_batch or per_gpu_batch")
    return ModelChoice(name=path.stem, path=path.resolve(), global_batch=batch or per_gpu,
                       per_gpu_batch=per_gpu, trace_batch=trace_batch)
