"""How a layer group combines its ranks' gradients: a closed set the plan records and the executor reads."""

from __future__ import annotations

import enum


class Combine(enum.Enum):
    SUM = "sum"
    """The all-reduce sum of the ranks' pre-scaled gradients: the gradient of the global mean loss."""
    ADASUM = "adasum"
    """Adasum (Maleki et al., MLSys 2021) of the ranks' own mean gradients, per layer; any group size
    (a group that is not a power of two folds its extra ranks in first: :mod:`deeppool.adaptation.adasum`)."""
