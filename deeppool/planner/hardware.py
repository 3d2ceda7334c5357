"""Device and network models: what a GPU and its interconnect can do.

A :class:`DeviceModel` estimates a layer's time from its FLOPs and the bytes
it touches (a roofline with an efficiency factor and a per-kernel launch
overhead), so a machine without the GPU can plan for it. Its peak depends on
the :class:`Precision` the model trains in (dense datasheet figures, TFLOP/s):

    =========  =====  =====  =====  =====
    GPU        fp32   tf32   bf16   fp16
    =========  =====  =====  =====  =====
    V100 SXM2  15.7   15.7   15.7   125
    A100 SXM4  19.5   156    312    312
    H100 SXM5  67     495    989    989
    H200 SXM   67     495    989    989
    =========  =====  =====  =====  =====

(V100 has no TF32 or bf16 tensor cores: those run at its fp32 rate). Memory:
V100 900 GB/s and 32 GiB, A100 80GB 2,039 GB/s, H100 3,350 GB/s, 80 GiB each; H200 4,800 GB/s and
141 GB. Sources, NVIDIA's datasheets (dense figures: the sheets print tensor-core rates with sparsity,
twice these): https://www.nvidia.com/en-us/data-center/v100/,
https://www.nvidia.com/en-us/data-center/a100/, https://www.nvidia.com/en-us/data-center/h100/,
https://www.nvidia.com/en-us/data-center/h200/ (``tests/planner/test_device_models.py`` holds the
sheets' figures).

**What PyTorch does with them.** PyTorch runs fp32 convolutions in TF32 by default
(``torch.backends.cudnn.allow_tf32`` is True) and fp32 matmuls in full fp32 unless told otherwise
(``torch.backends.cuda.matmul.allow_tf32``, ``torch.set_float32_matmul_precision("high")``): a model
prices an fp32 layer at the TF32 peak where its op runs in TF32 (:meth:`DeviceModel.peak_for`). And the
host issues every operator through the framework before the device runs it: ``host_op_s`` is a
per-operator floor under a layer's time (an fx node of the layer is one operator), measured where a
model names its source (``docs/gpu.md``, "Device models").

A :class:`NetworkModel` describes nodes: ``gpus_per_node`` GPUs joined by
NVLink at ``intra_bandwidth`` per GPU, and ``nics_per_node`` NICs of
``nic_bandwidth`` each to the other nodes (DGX-1 V100: 4 × 100 Gb/s; DGX A100:
8 × 200 Gb/s; DGX H100: 8 × 400 Gb/s). A group of ``g`` ranks 0..g-1 fills
nodes in order. Cross-node figures may not beat in-node ones (that would make
the planner's pruning lossy), so such a network is refused.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from deeppool.errors import DeeppoolError
from deeppool.plans import NetworkModel, Precision

GIB = 1024**3


@dataclass(frozen=True, kw_only=True)
class DeviceModel:
    """A GPU's roofline: peak FLOP/s per precision, memory bandwidth and size, kernel overhead."""

    name: str
    peak_flops: dict[Precision, float]
    mem_bandwidth: float
    memory_bytes: int
    launch_overhead_s: float = 5e-6
    compute_efficiency: float = 0.6
    bandwidth_efficiency: float = 0.8
    tf32_convolutions: bool = True
    """fp32 convolutions run at the TF32 peak: ``torch.backends.cudnn.allow_tf32``, True by default."""
    tf32_matmuls: bool = False
    """fp32 matmuls run at the TF32 peak: ``torch.backends.cuda.matmul.allow_tf32``, False by default."""
    host_fwd_op_s: float = 0.0
    """The host's floor per operator of a forward (issue through the framework); 0: not modelled."""
    host_bwd_op_s: float = 0.0
    """The same per operator of a backward (autograd's node and its kernels' issue); 0: not modelled."""

    def __post_init__(self) -> None:
        if set(self.peak_flops) != set(Precision):
            raise DeeppoolError(f"device model '{self.name}': give a peak for every precision")
        if min(*self.peak_flops.values(), self.mem_bandwidth, self.memory_bytes) <= 0:
            raise DeeppoolError(f"device model '{self.name}': figures must be positive")

    def peak(self, precision: Precision) -> float:
        return self.peak_flops[precision]

    def peak_for(self, op: str, precision: Precision) -> float:
        """The peak a layer whose op is ``op`` (a module's class name or a function's) runs at in ``precision``:
        an fp32 convolution or matmul at the TF32 peak where PyTorch runs it in TF32 (the flags above)."""
        if precision is Precision.FP32 and ((self.tf32_convolutions and op.lower().startswith("conv"))
                                            or (self.tf32_matmuls and op.lower() in MATMUL_OPS)):
            return self.peak_flops[Precision.TF32]
        return self.peak_flops[precision]


MATMUL_OPS = frozenset({"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "conv1d_as_linear"})
"""Ops (lower case) that run as cuBLAS matmuls, TF32 under ``torch.backends.cuda.matmul.allow_tf32``."""


class KnownDevice(enum.Enum):
    """The named GPUs deeppool can plan for without having one."""

    V100 = "v100"
    A100 = "a100"
    H100 = "h100"
    H200 = "h200"


H200_HOST_FWD_OP_S = 24.3e-6
H200_HOST_BWD_OP_S = 0.0
"""The H200 host's floor per operator (an fx node; forward, backward): the slope of a layer's recorded time at
batch 1 over its fx nodes, fitted by ``benchmarks/gpu_model.py --node-floor`` to the H200 profiles in
``docs/gpu-runs/2026-11-28-h200/`` (PyTorch 2.11, 16 cores); ``tests/planner/test_device_models.py`` checks them
against that fit. The backward's slope is 0 there: a recorded backward at batch 1 is the profiler's own
per-layer call (0.11 ms) whatever the layer's size (``docs/gpu.md``, "Device models")."""


def _peaks(fp32: float, tf32: float, bf16: float, fp16: float) -> dict[Precision, float]:
    return {Precision.FP32: fp32, Precision.TF32: tf32, Precision.BF16: bf16, Precision.FP16: fp16}


DEVICES: dict[KnownDevice, DeviceModel] = {
    KnownDevice.V100: DeviceModel(
        name="v100", peak_flops=_peaks(15.7e12, 15.7e12, 15.7e12, 125e12), mem_bandwidth=900e9,
        memory_bytes=32 * GIB,
    ),
    KnownDevice.A100: DeviceModel(
        name="a100", peak_flops=_peaks(19.5e12, 156e12, 312e12, 312e12), mem_bandwidth=2039e9,
        memory_bytes=80 * GIB,
    ),
    KnownDevice.H100: DeviceModel(
        name="h100", peak_flops=_peaks(67e12, 495e12, 989e12, 989e12), mem_bandwidth=3350e9,
        memory_bytes=80 * GIB,
    ),
    KnownDevice.H200: DeviceModel(
        name="h200", peak_flops=_peaks(67e12, 495e12, 989e12, 989e12), mem_bandwidth=4800e9,
        memory_bytes=141 * 10**9, host_fwd_op_s=H200_HOST_FWD_OP_S, host_bwd_op_s=H200_HOST_BWD_OP_S,
    ),
}

NETWORKS: dict[KnownDevice, NetworkModel] = {
    KnownDevice.V100: NetworkModel(
        gpus_per_node=8, intra_bandwidth=150e9, nics_per_node=4, nic_bandwidth=12.5e9,
        intra_latency_s=5e-6, inter_latency_s=10e-6,
    ),
    KnownDevice.A100: NetworkModel(
        gpus_per_node=8, intra_bandwidth=300e9, nics_per_node=8, nic_bandwidth=25e9,
        intra_latency_s=4e-6, inter_latency_s=8e-6,
    ),
    KnownDevice.H100: NetworkModel(
        gpus_per_node=8, intra_bandwidth=450e9, nics_per_node=8, nic_bandwidth=50e9,
        intra_latency_s=3e-6, inter_latency_s=6e-6,
    ),
    KnownDevice.H200: NetworkModel(
        gpus_per_node=8, intra_bandwidth=450e9, nics_per_node=8, nic_bandwidth=50e9,
        intra_latency_s=3e-6, inter_latency_s=6e-6,
    ),
}
"""DGX-1 V100 (NVLink, 4 × 100 Gb/s), DGX A100 (8 × 200 Gb/s), DGX H100 and DGX H200 (8 × 400 Gb/s)."""

LOCAL_NETWORK = NetworkModel(
    gpus_per_node=64, intra_bandwidth=5e9, nics_per_node=1, nic_bandwidth=1.25e9 * 64,
    intra_latency_s=50e-6, inter_latency_s=100e-6, allreduce_overlap=0.0,
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
