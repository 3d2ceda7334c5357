"""Scheduling policies, shared by the coordinator and the simulator.

A policy is a pure function ``decide(snapshot) -> Decision`` over a typed,
read-only :class:`Snapshot` (:mod:`~deeppool.scheduling.contract`, the
contract). The policies themselves, an order (FIFO, FIFO with backfilling,
Tiresias) crossed with a placement (data parallel, burst, with or without
background jobs), are in :mod:`~deeppool.scheduling.policies`; the default,
``burst+demand`` (plans for the background that is waiting, no job demoted),
in :mod:`~deeppool.scheduling.demand`; Pollux's
co-adaptive policy (GPUs and batch sizes for goodput) in
:mod:`~deeppool.scheduling.pollux`. The simulator's
engine (:mod:`deeppool.cluster_sim.engine`) and the coordinator's service
(:mod:`deeppool.coordinator.service`) both build snapshots and apply
decisions, so the same code decides in both.
"""

from deeppool.scheduling.choice import ModelChoice
from deeppool.scheduling.contract import (
    NOTHING, Adaptive, Decision, Lend, PlanMode, PlanOffer, PlanState, Policy, Rebatch, Replan, SimJob, Slot, Snapshot,
    SpeedModel, Start,
)
from deeppool.scheduling.policies import BASELINE, POLICIES, Order, Placement, Scheduler, policy_named
from deeppool.scheduling.demand import DemandPolicy
from deeppool.scheduling.pollux import PolluxPolicy

__all__ = [
    "BASELINE", "NOTHING", "POLICIES", "Adaptive", "Decision", "DemandPolicy", "Lend", "ModelChoice", "Order",
    "Placement", "PlanMode", "PlanOffer", "PlanState", "Policy", "PolluxPolicy", "Rebatch", "Replan", "Scheduler",
    "SimJob", "Slot", "Snapshot", "SpeedModel", "Start", "policy_named",
]
