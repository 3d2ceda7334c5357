"""The simulated cluster: nodes × GPUs per node, with the planner's device and network models."""

from __future__ import annotations

from dataclasses import dataclass

from deeppool.errors import DeeppoolError
from deeppool.plans import NetworkModel
from deeppool.planner.hardware import DEVICES, NETWORKS, DeviceModel, KnownDevice


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """``gpus`` GPUs of model ``device`` in nodes of ``gpus_per_node``."""

    gpus: int
    gpus_per_node: int
    device: KnownDevice = KnownDevice.A100

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise DeeppoolError(f"--gpus {self.gpus}: the cluster needs at least one GPU")
        if self.gpus_per_node < 1:
            raise DeeppoolError(f"--gpus-per-node {self.gpus_per_node}: a node needs at least one GPU")
        if self.gpus % self.gpus_per_node:
            raise DeeppoolError(
                f"--gpus {self.gpus} is not a multiple of --gpus-per-node {self.gpus_per_node}: "
                "the cluster is whole nodes"
            )

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def device_model(self) -> DeviceModel:
        return DEVICES[self.device]

    @property
    def network(self) -> NetworkModel:
        """The planner's network preset for ``device``, with this cluster's node size."""
        return NETWORKS[self.device].with_overrides(gpus_per_node=self.gpus_per_node)

    def describe(self) -> str:
        return f"{self.gpus} x {self.device.value} ({self.nodes} nodes x {self.gpus_per_node})"
