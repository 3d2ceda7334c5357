"""The plan: the contract between planning and running (JSON, versioned, validated on load).

A :class:`Plan` names, for every layer, its GPU count, the ranks that run it and each rank's sample range of
the global batch, with the predicted times; then the predicted iteration, the idle windows that background
jobs will get, and how the solver did. Everything that reads a plan imports it from here; this package
imports nothing of deeppool but :mod:`deeppool.errors`, so reading a plan never loads the cost model, the
solver or torch. The planner builds plans (:func:`deeppool.planner.solve.build.build_plan`).
"""

from deeppool.plans.branch import Branch
from deeppool.plans.enums import Combine, Objective, Optimizer, Precision, Strategy
from deeppool.plans.goodput import BatchChoice, GoodputSearch
from deeppool.plans.network import NETWORK_SCHEMA_VERSION, NetworkModel
from deeppool.plans.pin import Pin
from deeppool.plans.plan import (
    PLAN_SCHEMA_VERSION,
    WEAK,
    ClusterShares,
    Evidence,
    IdleWindow,
    Plan,
    PlannedLayer,
    Prediction,
    SolverInfo,
    sample_ranges,
    validate,
)
from deeppool.plans.spec import ModelSource, ModelSpec

__all__ = [
    "NETWORK_SCHEMA_VERSION", "PLAN_SCHEMA_VERSION", "WEAK", "BatchChoice", "Branch", "ClusterShares", "Combine",
    "Evidence", "GoodputSearch", "IdleWindow", "ModelSource", "ModelSpec", "NetworkModel", "Objective",
    "Optimizer", "Pin", "Plan", "PlannedLayer", "Precision", "Prediction", "SolverInfo", "Strategy",
    "sample_ranges", "validate",
]
