"""The network a plan is for: nodes of GPUs, NVLink inside, NICs across, and what an all-reduce costs on it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from deeppool.errors import DeeppoolError
from deeppool.plans import jsonio

NETWORK_SCHEMA_VERSION = 1
"""Version of a network file (``deeppool profile-network``): ``artifact: network``."""


@dataclass(frozen=True, kw_only=True)
class NetworkModel:
    """Nodes of ``gpus_per_node`` GPUs: NVLink per GPU inside, ``nics_per_node`` NICs across.

    Bandwidths are bytes/s, latencies seconds. ``allreduce_efficiency`` (η) and
    ``allreduce_latency_factor`` (λ) scale them for all-reduce (1 for the
    presets; measured by ``deeppool profile-network``). ``allreduce_overlap``
    (ω) is the share of the backward that an asynchronous all-reduce can hide
    behind: 1 on GPUs (NCCL runs beside the compute kernels), 0 for gloo on a
    host's CPU cores, where the reduction competes with the compute for them.
    ``wakeup_s`` (ω_w) is what handing data on after ranks computed together (a
    stage on several ranks sending its output, or its input gradients, to rank
    0) costs beyond one message between idle ranks: gloo's threads must be
    scheduled again on cores the compute held, and ranks time-sliced on shared
    cores finish apart. ``sync_s`` holds it by the stage's rank count where
    measured (:meth:`sync_latency_s`); 0 for the presets, measured by ``deeppool
    profile-network`` on a host whose cores the ranks share. ``skew`` is what
    the first collective after a stage's compute waits beyond those figures,
    per second of compute past ``skew_after_s`` (the compute the probe ran
    before its collectives): ranks time-sliced on shared cores finish the same
    work further apart the longer it is. By rank count where measured
    (:meth:`skew_per_s`); empty for the presets and on GPUs.
    """

    gpus_per_node: int
    intra_bandwidth: float
    nics_per_node: int
    nic_bandwidth: float
    intra_latency_s: float
    inter_latency_s: float
    allreduce_efficiency: float = 1.0
    allreduce_latency_factor: float = 1.0
    allreduce_overlap: float = 1.0
    wakeup_s: float = 0.0
    sync_s: dict[int, float] = field(default_factory=dict)
    skew: dict[int, float] = field(default_factory=dict)
    skew_after_s: float = 0.0

    def __post_init__(self) -> None:
        if self.wakeup_s < 0 or any(value < 0 for value in self.sync_s.values()):
            raise DeeppoolError(f"the wake-up latency {self.wakeup_s} s must be >= 0")
        if any(ranks < 2 for ranks in self.sync_s):
            raise DeeppoolError("a synchronisation latency is for a stage of 2 or more ranks")
        if any(ranks < 2 or value < 0 for ranks, value in self.skew.items()) or self.skew_after_s < 0:
            raise DeeppoolError("a skew is for a stage of 2 or more ranks, at least 0, after at least 0 s")
        if self.allreduce_efficiency <= 0 or self.allreduce_latency_factor < 0:
            raise DeeppoolError("the all-reduce efficiency must be positive and its latency factor >= 0")
        if not 0 <= self.allreduce_overlap <= 1:
            raise DeeppoolError(f"the all-reduce overlap {self.allreduce_overlap} must be within 0..1")
        if self.gpus_per_node < 1 or self.nics_per_node < 1:
            raise DeeppoolError("--gpus-per-node and the NICs per node must be at least 1")
        if min(self.intra_bandwidth, self.nic_bandwidth) <= 0:
            raise DeeppoolError("network bandwidths must be positive")
        if min(self.intra_latency_s, self.inter_latency_s) < 0:
            raise DeeppoolError("network latencies must be >= 0")
        if self.inter_bandwidth > self.intra_bandwidth * (1 + 1e-9) or self.inter_latency_s < self.intra_latency_s:
            raise DeeppoolError(
                f"cross-node figures ({self.inter_bandwidth / 1e9:g} GB/s per GPU, {self.inter_latency_s * 1e6:g} us) "
                f"beat in-node ones ({self.intra_bandwidth / 1e9:g} GB/s, {self.intra_latency_s * 1e6:g} us): "
                "no real cluster does; check --intra-gbps/--inter-gbps or the network file"
            )

    @classmethod
    def flat(cls, *, gpus_per_node: int, bandwidth: float, latency_s: float, **extra: float) -> NetworkModel:
        """One link speed everywhere (processes on one host: every rank is its own 'NIC')."""
        return cls(
            gpus_per_node=gpus_per_node, intra_bandwidth=bandwidth, nics_per_node=gpus_per_node,
            nic_bandwidth=bandwidth, intra_latency_s=latency_s, inter_latency_s=latency_s, **extra,
        )

    @property
    def node_bandwidth(self) -> float:
        """Bytes/s a node sends to the others over all its NICs."""
        return self.nics_per_node * self.nic_bandwidth

    @property
    def inter_bandwidth(self) -> float:
        """Cross-node bandwidth per GPU of a full node (its share of the node's NICs)."""
        return self.node_bandwidth / self.gpus_per_node

    def nodes(self, gpus: int) -> int:
        return math.ceil(gpus / self.gpus_per_node)

    def sync_latency_s(self, gpus: int) -> float:
        """``ω_w(g)``: the figure of the largest measured count ≤ ``gpus`` (else of the smallest measured),
        ``wakeup_s`` where none was measured; 0 for one rank."""
        if gpus < 2:
            return 0.0
        return _by_count(self.sync_s, gpus) if self.sync_s else self.wakeup_s

    def skew_per_s(self, gpus: int) -> float:
        """The skew's slope for a stage of ``gpus`` ranks, chosen as :meth:`sync_latency_s` chooses; 0 for
        one rank or where none was measured."""
        return _by_count(self.skew, gpus) if gpus >= 2 and self.skew else 0.0

    def allreduce_s(self, gpus: int, nbytes: float, *, latencies: float = 1.0) -> float:
        """Hierarchical all-reduce of ``nbytes`` on ranks 0..gpus-1 (NCCL's ring inside, then across nodes).

        With ``k = min(g, gpus_per_node)`` ranks per node and ``n`` nodes:
        ``2(k−1)/k · S/(η·BW_nvlink) + 2(n−1)/n · S/(η·BW_node) + latencies·λ·(2⌈log₂k⌉·α_in + 2⌈log₂n⌉·α_x)``:
        reduce-scatter and all-gather inside the node, then each rank's ``S/k``
        shard across nodes over its own NIC share, all NICs of a node busy.
        """
        if gpus <= 1:
            return 0.0
        local, nodes = min(gpus, self.gpus_per_node), self.nodes(gpus)
        eta = self.allreduce_efficiency
        seconds = 2 * (local - 1) / local * nbytes / (eta * self.intra_bandwidth)
        seconds += 2 * (nodes - 1) / nodes * nbytes / (eta * self.node_bandwidth)
        hops = 2 * math.ceil(math.log2(local)) * self.intra_latency_s
        hops += 2 * math.ceil(math.log2(nodes)) * self.inter_latency_s if nodes > 1 else 0.0
        return seconds + latencies * self.allreduce_latency_factor * hops

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "sync_s": {str(count): value for count, value in sorted(self.sync_s.items())},
                "skew": {str(count): value for count, value in sorted(self.skew.items())}}

    @classmethod
    def load(cls, path: str | Path) -> NetworkModel:
        """Read a network file written by ``deeppool profile-network``."""
        payload = jsonio.read_json(path, kind="network", schema_version=NETWORK_SCHEMA_VERSION)
        try:
            return cls.from_json(payload)
        except DeeppoolError as err:
            raise DeeppoolError(f"network file '{path}': {err}") from None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NetworkModel:
        """A network from JSON; an older file's per-GPU ``inter_bandwidth`` becomes one NIC per GPU."""
        fields = dict(data)
        if "inter_bandwidth" in fields and "nic_bandwidth" not in fields:
            fields["nic_bandwidth"] = fields.pop("inter_bandwidth")
            fields.setdefault("nics_per_node", fields.get("gpus_per_node"))
        try:
            fields["sync_s"] = {int(count): float(value) for count, value in dict(fields.get("sync_s") or {}).items()}
            fields["skew"] = {int(count): float(value) for count, value in dict(fields.get("skew") or {}).items()}
            return cls(**{key: fields[key] for key in cls.__dataclass_fields__ if key in fields or key not in _OPTIONAL})
        except (KeyError, TypeError, ValueError) as err:
            raise DeeppoolError(f"network JSON is incomplete ({err}): regenerate it") from None

    def with_overrides(
        self, *, gpus_per_node: int | None = None, intra_gbps: float | None = None,
        inter_gbps: float | None = None,
    ) -> NetworkModel:
        """This network with some figures replaced (bandwidths in GB/s; ``inter_gbps`` per GPU of a full node)."""
        changes: dict[str, Any] = {}
        if gpus_per_node is not None:
            changes["gpus_per_node"] = gpus_per_node
        if intra_gbps is not None:
            changes["intra_bandwidth"] = intra_gbps * 1e9
        if inter_gbps is not None:
            node_gpus = changes.get("gpus_per_node", self.gpus_per_node)
            changes["nic_bandwidth"] = inter_gbps * 1e9 * node_gpus / self.nics_per_node
        return replace(self, **changes)


def _by_count(measured: dict[int, float], gpus: int) -> float:
    """The figure of the largest measured rank count ≤ ``gpus``, else of the smallest measured."""
    below = [count for count in measured if count <= gpus]
    return measured[max(below) if below else min(measured)]


_OPTIONAL = ("allreduce_efficiency", "allreduce_latency_factor", "allreduce_overlap", "wakeup_s", "sync_s", "skew",
             "skew_after_s")
