"""``serve --policy``: the names ``simulate --policy`` takes, each run live or refused in one line saying why.

Every policy of :data:`deeppool.scheduling.POLICIES` is a pure ``decide(snapshot)``; the coordinator builds
the snapshot from its database and applies the decision (:mod:`deeppool.coordinator.service`). What it can
apply: starts, preemptions, loans of running hosts' idle ranks, and, for a co-adaptive policy (``pollux``),
resizes and batch changes of running jobs (:mod:`deeppool.coordinator.elastic`), whose jobs then run
resizable and measure their gradient noise scale. Each job is planned by the planner for the GPUs it is
given: a placement's plan mode (``dp``, ``burst``) names the simulator's plan choice, not the live one's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from deeppool.errors import DeeppoolError
from deeppool.scheduling import Policy, PolluxPolicy, policy_named
from deeppool.scheduling.policies import ADAPTIVE

REFUSED = {
    "burst+demand": "it weighs each job's plan offers and predicted run time and re-plans running jobs, and the "
                    "coordinator computes no plan offers yet: use fifo-backfill:burst+bg",
}
"""Policy names that cannot run live, with why."""
DEFAULT = "fifo-backfill:burst+bg"


@dataclass(frozen=True, kw_only=True)
class LivePolicy:
    """A policy as the coordinator runs it: ``elastic``: it resizes running jobs (they run resizable);
    ``measures_noise``: its jobs measure their gradient noise scale (it changes their batch by it)."""

    policy: Policy
    elastic: bool
    measures_noise: bool


def live_policy(name: str, *, interval_s: float | None = None) -> LivePolicy:
    """The policy ``serve --policy NAME`` runs; an unknown name or one that cannot run live is one line.

    ``interval_s`` (``serve --policy-interval``) replaces the interval of a policy that decides on a wall-clock
    tick (``pollux``: 60 s by default); any other policy decides at every event and refuses it in one line."""
    policy = policy_named(name)
    if name in REFUSED:
        raise DeeppoolError(f"--policy {name} cannot run in the coordinator: {REFUSED[name]}")
    if interval_s is not None:
        policy = _with_interval(policy, interval_s)
    adaptive = name in ADAPTIVE
    return LivePolicy(policy=policy, elastic=adaptive, measures_noise=adaptive)


def _with_interval(policy: Policy, interval_s: float) -> Policy:
    if not isinstance(policy, PolluxPolicy):
        raise DeeppoolError(f"--policy-interval is for a policy that decides on a tick (pollux): {policy.name} "
                            "decides at every event")
    if not interval_s > 0:
        raise DeeppoolError(f"--policy-interval {interval_s} must be more than 0 seconds")
    return replace(policy, interval_s=interval_s)
