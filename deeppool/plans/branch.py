"""A branch on a tensor's value that the tracer specialised, recorded in the plan so ``run`` can check it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Branch:
    """A branch on a tensor's value that the tracer specialised: where, and which way it went."""

    file: str
    line: int
    taken: bool

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "taken": self.taken}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Branch:
        return cls(file=str(data["file"]), line=int(data["line"]), taken=bool(data["taken"]))
