"""Device and network models: what a GPU and its interconnect can do.

A :class:`DeviceModel` estimates a layer's time from its FLOPs and the bytes
it touches (a roofline with an efficiency factor and a per-kernel launch
overhead), so a machine without the GPU can plan for it. Figures are vendor
datasheet numbers: V100 SXM2 (15.7 TFLOP/s FP32, 900 GB/s HBM2, 32 GiB), A100
SXM4 80GB (156 TFLOP/s TF32, 2,039 GB/s HBM2e, 80 GiB), H100 SXM5 (495 TFLOP/s
TF32 dense, 3,350 GB/s HBM3, 80 GiB). A :class:`NetworkModel` gives per-GPU
bandwidth and latency inside a node (NVLink) and across nodes (InfiniBand,
one NIC per GPU as in DGX systems).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from deeppool.errors import DeeppoolError
from deeppool.planner import jsonio

GIB = 1024**3
NETWORK_SCHEMA_VERSION = 1
"""Version of a network file (``deeppool profile-network``): ``artifact: network``."""


@dataclass(frozen=True, kw_only=True)
class DeviceModel:
    """A GPU's roofline: peak FLOP/s, memory bandwidth and size, kernel overhead."""

    name: str
    peak_flops: float
    mem_bandwidth: float
    memory_bytes: int
    launch_overhead_s: float = 5e-6
    compute_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8

    def __post_init__(self) -> None:
        if min(self.peak_flops, self.mem_bandwidth, self.memory_bytes) <= 0:
            raise DeeppoolError(f"device model '{self.name}': figures must be positive")


@dataclass(frozen=True, kw_only=True)
class NetworkModel:
    """Per-GPU bandwidth (bytes/s) and latency (s) inside a node and across nodes."""

    gpus_per_node: int
    intra_bandwidth: float
    inter_bandwidth: float
    intra_latency_s: float
    inter_latency_s: float
    allreduce_efficiency: float = 1.0
    allreduce_latency_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.allreduce_efficiency <= 0 or self.allreduce_latency_factor < 0:
            raise DeeppoolError("the all-reduce efficiency must be positive and its latency factor >= 0")
        if self.gpus_per_node < 1:
            raise DeeppoolError("--gpus-per-node must be at least 1")
        if min(self.intra_bandwidth, self.inter_bandwidth) <= 0:
            raise DeeppoolError("network bandwidths must be positive")
        if min(self.intra_latency_s, self.inter_latency_s) < 0:
            raise DeeppoolError("network latencies must be >= 0")

    def bandwidth(self, gpus: int) -> float:
        """Bandwidth seen by a group of ``gpus`` ranks 0..gpus-1 (node-local if they fit)."""
        return self.intra_bandwidth if gpus <= self.gpus_per_node else self.inter_bandwidth

    def latency_s(self, gpus: int) -> float:
        return self.intra_latency_s if gpus <= self.gpus_per_node else self.inter_latency_s

    def allreduce_bandwidth(self, gpus: int) -> float:
        """The bandwidth an all-reduce attains (a measured gloo all-reduce also sums on the CPU)."""
        return self.bandwidth(gpus) * self.allreduce_efficiency

    def allreduce_latency_s(self, gpus: int) -> float:
        return self.latency_s(gpus) * self.allreduce_latency_factor

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

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
        try:
            return cls(**{key: data[key] for key in cls.__dataclass_fields__ if key in data or key not in _OPTIONAL})
        except (KeyError, TypeError) as err:
            raise DeeppoolError(f"network JSON is incomplete ({err}): regenerate it") from None

    def with_overrides(
        self, *, gpus_per_node: int | None = None, intra_gbps: float | None = None,
        inter_gbps: float | None = None,
    ) -> NetworkModel:
        """This network with some figures replaced (bandwidths in GB/s)."""
        changes: dict[str, Any] = {}
        if gpus_per_node is not None:
            changes["gpus_per_node"] = gpus_per_node
        if intra_gbps is not None:
            changes["intra_bandwidth"] = intra_gbps * 1e9
        if inter_gbps is not None:
            changes["inter_bandwidth"] = inter_gbps * 1e9
        return replace(self, **changes)


_OPTIONAL = ("allreduce_efficiency", "allreduce_latency_factor")


class KnownDevice(enum.Enum):
    """The named GPUs deeppool can plan for without having one."""

    V100 = "v100"
    A100 = "a100"
    H100 = "h100"


DEVICES: dict[KnownDevice, DeviceModel] = {
    KnownDevice.V100: DeviceModel(
        name="v100", peak_flops=15.7e12, mem_bandwidth=900e9, memory_bytes=32 * GIB
    ),
    KnownDevice.A100: DeviceModel(
        name="a100", peak_flops=156e12, mem_bandwidth=2039e9, memory_bytes=80 * GIB
    ),
    KnownDevice.H100: DeviceModel(
        name="h100", peak_flops=495e12, mem_bandwidth=3350e9, memory_bytes=80 * GIB
    ),
}

NETWORKS: dict[KnownDevice, NetworkModel] = {
    KnownDevice.V100: NetworkModel(
        gpus_per_node=8, intra_bandwidth=150e9, inter_bandwidth=12.5e9,
        intra_latency_s=5e-6, inter_latency_s=10e-6,
    ),
    KnownDevice.A100: NetworkModel(
        gpus_per_node=8, intra_bandwidth=300e9, inter_bandwidth=25e9,
        intra_latency_s=4e-6, inter_latency_s=8e-6,
    ),
    KnownDevice.H100: NetworkModel(
        gpus_per_node=8, intra_bandwidth=450e9, inter_bandwidth=50e9,
        intra_latency_s=3e-6, inter_latency_s=6e-6,
    ),
}

LOCAL_NETWORK = NetworkModel(
    gpus_per_node=64, intra_bandwidth=5e9, inter_bandwidth=1.25e9,
    intra_latency_s=50e-6, inter_latency_s=100e-6,
)
"""Processes on one host talking through gloo over shared memory / loopback."""


def known_device(name: str) -> KnownDevice:
    """Parse a device-model name, or a one-line error listing the known ones."""
    try:
        return KnownDevice(name.lower())
    except ValueError:
        names = ", ".join(device.value for device in KnownDevice)
        raise DeeppoolError(
            f"unknown device model '{name}': use one of {names}, or 'local' to measure"
        ) from None
