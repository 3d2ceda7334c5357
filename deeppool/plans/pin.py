"""A user's fixed GPU count for the layers whose names match a pattern (``--pin``)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from deeppool.errors import DeeppoolError


@dataclass(frozen=True, kw_only=True)
class Pin:
    """Layers whose names match ``pattern`` run on ``gpus`` GPUs."""

    pattern: str
    gpus: int

    def __post_init__(self) -> None:
        if not self.pattern:
            raise DeeppoolError("--pin needs a layer-name pattern before '=', e.g. --pin 'layer4.*=8'")
        if self.gpus < 1:
            raise DeeppoolError(f"--pin '{self}': a layer runs on at least 1 GPU")

    def __str__(self) -> str:
        return f"{self.pattern}={self.gpus}"

    @classmethod
    def parse(cls, text: str) -> Pin:
        """``GLOB=N``, e.g. ``conv*=4``; the last ``=`` separates the count."""
        pattern, sep, count = text.rpartition("=")
        if not sep:
            raise DeeppoolError(f"--pin '{text}' is not GLOB=N: give e.g. --pin 'layer4.*=8'")
        try:
            gpus = int(count)
        except ValueError:
            raise DeeppoolError(f"--pin '{text}': '{count}' is not a GPU count, give e.g. --pin 'layer4.*=8'") from None
        return cls(pattern=pattern.strip(), gpus=gpus)

    def matches(self, name: str) -> bool:
        return fnmatch.fnmatchcase(name, self.pattern)

    def to_json(self) -> dict[str, Any]:
        return {"pattern": self.pattern, "gpus": self.gpus}

    @classmethod
    def from_json(cls, data: Any) -> Pin:
        return cls(pattern=str(data["pattern"]), gpus=int(data["gpus"]))
