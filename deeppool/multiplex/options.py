"""The background options of ``deeppool run`` and ``deeppool multiplex bench``: :class:`BackgroundConfig`'s
fields (:mod:`deeppool.options`), and the config built from them."""

from __future__ import annotations

from pathlib import Path

from deeppool import checks
from deeppool.multiplex.config import BackgroundConfig
from deeppool.options import Given, Group

RUN_BACKGROUND = Group(BackgroundConfig, optional=True)
"""``deeppool run``'s background options: no background unless ``--background`` is given."""
BENCH_BACKGROUND = Group(BackgroundConfig, only=("model", "batch", "optimizer", "slowdown_target", "piece_ms"))
"""``deeppool multiplex bench``'s: the background it measures in each mode (``--background`` required)."""


def background_config(given: Given, out: Path) -> BackgroundConfig | None:
    """The background of ``deeppool run``'s options (None without ``--background``), its model file and checkpoint
    folder (``OUT/background`` unless given) absolute, for ranks started elsewhere."""
    if not given.present:
        return None
    checks.positive(given["optimizer.lr"], "--bg-lr")
    return given.build({"model": given["model"].resolve(),
                        "checkpoint_dir": (given["checkpoint_dir"] or out / "background").resolve()})
