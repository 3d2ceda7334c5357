"""The layer-time cache: a JSON file of measurements by key (:class:`ProfileCache`), and the digest of the code a
layer runs (:func:`layer_code`) that the keys are made of, so the cache never returns another code's times."""

from __future__ import annotations

import hashlib
import inspect
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import cache
from pathlib import Path

from torch import fx

from deeppool.model.graph import Layer
from deeppool.plans.jsonio import write_json
from deeppool.planner.profiling.stats import Measured


CACHE_FILE = "layer-times.json"


CACHE_SCHEMA_VERSION = 2
"""Version 2: every entry records what it was measured under; older files are not read (not trusted)."""


class ProfileCache:
    """A JSON file of measurements by measurement key, written as it fills (at most once per ``every_s``).

    Each entry holds the medians, their spread and the conditions of the measurement: load,
    cores, intra-op threads, torch's version, the device and when."""

    def __init__(self, directory: Path, every_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = directory / CACHE_FILE
        self.entries: dict[str, dict[str, object]] = {}
        self._every_s, self._clock = every_s, clock
        self._saved_at = clock()
        if self.path.is_file():
            try:
                payload = json.loads(self.path.read_text())
            except json.JSONDecodeError:
                payload = {}
            if isinstance(payload, dict) and payload.get("schema_version") == CACHE_SCHEMA_VERSION:
                self.entries = dict(payload.get("entries") or {})

    def get(self, key: str) -> Measured | None:
        found = self.entries.get(key)
        if not isinstance(found, dict):
            return None
        try:
            return Measured(fwd_ms=float(found["fwd_ms"]), bwd_ms=float(found["bwd_ms"]),
                            spread=float(found["spread"]), load=float(found["load"]),
                            reference_ms=float(found.get("reference_ms", 0.0)),
                            speed_change=float(found.get("speed_change", 0.0)))
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, key: str, measured: Measured, conditions: dict[str, object] | None = None) -> None:
        self.entries[key] = {**asdict(measured), **(conditions or {}), "at": time.time()}
        if self._clock() - self._saved_at >= self._every_s:
            self.save()

    def save(self) -> None:
        write_json(self.path, {"schema_version": CACHE_SCHEMA_VERSION, "entries": self.entries})
        self._saved_at = self._clock()


def clear_cache(directory: Path) -> int:
    """Remove the layer-time cache in ``directory``; the number of entries it held (0: there was none)."""
    path = directory / CACHE_FILE
    if not path.is_file():
        return 0
    count = len(ProfileCache(directory).entries)
    path.unlink()
    return count


def layer_code(module: fx.GraphModule, layer: Layer, *, by_path: bool = True) -> str:
    """A digest of the code a layer runs: each of its fx nodes (kind, target, constant arguments) and, for a
    module or a Python function, its class's or its own source and the module's settings; a change of the
    model's code changes it, so the cache never returns another code's times. ``by_path=False`` leaves out
    the submodules' paths: two layers that run the same code on different weights then have one digest."""
    by_name = {node.name: node for node in module.graph.nodes}
    parts = []
    for name in layer.nodes:
        node = by_name[name]
        constants = fx.node.map_arg((node.args, node.kwargs), lambda _: "%")
        target = node.target if by_path or node.op not in ("call_module", "get_attr") else ""
        parts.append(f"{node.op}|{target}|{constants!r}|{_target_code(module, node)}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _target_code(module: fx.GraphModule, node: fx.Node) -> str:
    if node.op == "call_module":
        called = module.get_submodule(str(node.target))
        kind = type(called)
        return f"{kind.__module__}.{kind.__qualname__}({called.extra_repr()})|{source_digest(kind)}"
    if node.op == "call_function":
        return source_digest(node.target)
    return ""


def source_digest(code: object) -> str:
    """A digest of the source of a Python class or function ('' for a builtin or one without source)."""
    try:
        return _cached_source(code)
    except TypeError:  # unhashable: a callable object
        return ""


@cache
def _cached_source(code: object) -> str:
    try:
        return hashlib.sha256(inspect.getsource(code).encode()).hexdigest()[:16]  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ""
