"""Versioned JSON files shared by the planner's artifacts (LayerGraph, Profile, Plan)."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

from deeppool.errors import DeeppoolError


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` atomically: a crash never leaves a half-written file.

    Each writer has its own temporary file, so processes that write the same
    cache entry at once (the simulator's planning pool) never take each
    other's file; the last rename wins with a whole file.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        tmp.write_text(json.dumps(payload, indent=1) + "\n")
        tmp.replace(target)
    finally:
        tmp.unlink(missing_ok=True)


def read_json(path: str | Path, *, kind: str, schema_version: int) -> dict[str, Any]:
    """Read a ``kind`` JSON file and check its ``schema_version``."""
    source = Path(path)
    if not source.is_file():
        raise DeeppoolError(f"{kind} file '{path}' does not exist: check the path")
    try:
        payload = json.loads(source.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DeeppoolError(
            f"{kind} file '{path}' is not valid JSON ({err}): regenerate it"
        ) from None
    return check_version(payload, kind=kind, schema_version=schema_version, where=str(path))


def check_version(
    payload: Any, *, kind: str, schema_version: int, where: str = "input"
) -> dict[str, Any]:
    """Refuse a payload that is not a ``kind`` object of the expected version."""
    if not isinstance(payload, dict):
        raise DeeppoolError(f"{kind} {where} is not a JSON object: regenerate it")
    artifact = payload.get("artifact")
    if artifact != kind:
        raise DeeppoolError(f"{kind} {where} is not a {kind} JSON (artifact: {artifact or 'none'}): pass a {kind} file")
    found = payload.get("schema_version")
    if found != schema_version:
        raise DeeppoolError(
            f"{kind} {where} has schema_version {found!r}, this deeppool reads "
            f"{schema_version}: regenerate it with this version"
        )
    return payload


def field(payload: dict[str, Any], key: str, *, kind: str) -> Any:
    """Return ``payload[key]`` or a one-line error naming the missing key."""
    if key not in payload:
        raise DeeppoolError(f"{kind} JSON lacks the key '{key}': the file is corrupted, regenerate it")
    return payload[key]
