"""The device and network models' figures against NVIDIA's published datasheets, within a stated tolerance.

The figures below are typed from the datasheets (dense, no sparsity; SXM parts), not read from
:mod:`deeppool.planner.hardware`, so a typo or a sparse figure in the models fails here:

* V100: "NVIDIA Tesla V100 GPU Accelerator" datasheet (SXM2): FP32 15.7 TFLOPS, Tensor
  Performance 125 TFLOPS, HBM2 900 GB/s, 32 GB; NVLink 300 GB/s (both directions).
* A100: "NVIDIA A100 Tensor Core GPU" datasheet (80GB SXM): FP32 19.5 TFLOPS, TF32 156 TFLOPS,
  BFLOAT16/FP16 Tensor Core 312 TFLOPS, GPU memory bandwidth 2,039 GB/s, 80 GB; NVLink 600 GB/s.
* H100: "NVIDIA H100 Tensor Core GPU" datasheet (SXM): FP32 67 TFLOPS, TF32 Tensor Core 989
  TFLOPS with sparsity (494.5 dense), BFLOAT16/FP16 1,979 with sparsity (989.5 dense), 3.35 TB/s,
  80 GB; NVLink 900 GB/s.
* Nodes: DGX-1 4 × 100 Gb/s InfiniBand, DGX A100 8 × 200 Gb/s, DGX H100 8 × 400 Gb/s.
"""

from __future__ import annotations

import pytest

from deeppool.plans import Precision
from deeppool.planner.hardware import DEVICES, GIB, NETWORKS, KnownDevice

RATE_TOLERANCE = 0.02
"""Datasheets round (TF32 on H100: 494.5 dense, the model says 495): 2% covers rounding, never a 2x slip."""
MEMORY_TOLERANCE = 0.05
"""A datasheet's "80 GB" is decimal or binary depending on the part: 5%."""

TERA, GIGA = 1e12, 1e9
DATASHEET = {
    KnownDevice.V100: {"fp32": 15.7, "tf32": 15.7, "bf16": 15.7, "fp16": 125.0, "bandwidth": 900.0,
                       "memory_gb": 32, "nvlink_one_way": 150.0, "nic": 100 / 8, "nics": 4},
    KnownDevice.A100: {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0, "bandwidth": 2039.0,
                       "memory_gb": 80, "nvlink_one_way": 300.0, "nic": 200 / 8, "nics": 8},
    KnownDevice.H100: {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "bandwidth": 3350.0,
                       "memory_gb": 80, "nvlink_one_way": 450.0, "nic": 400 / 8, "nics": 8},
}


@pytest.mark.parametrize("device", list(DATASHEET), ids=lambda d: d.value)
def test_device_model_matches_the_datasheet(device: KnownDevice) -> None:
    sheet, model = DATASHEET[device], DEVICES[device]
    for precision in Precision:
        assert model.peak_flops[precision] / TERA == pytest.approx(sheet[precision.value], rel=RATE_TOLERANCE), \
            f"{device.value} {precision.value} peak"
    assert model.mem_bandwidth / GIGA == pytest.approx(sheet["bandwidth"], rel=RATE_TOLERANCE)
    assert model.memory_bytes / GIB == pytest.approx(sheet["memory_gb"], rel=MEMORY_TOLERANCE)


@pytest.mark.parametrize("device", list(DATASHEET), ids=lambda d: d.value)
def test_network_model_matches_the_datasheet(device: KnownDevice) -> None:
    sheet, network = DATASHEET[device], NETWORKS[device]
    assert network.intra_bandwidth / GIGA == pytest.approx(sheet["nvlink_one_way"], rel=RATE_TOLERANCE)
    assert network.nic_bandwidth / GIGA == pytest.approx(sheet["nic"], rel=RATE_TOLERANCE)
    assert network.nics_per_node == sheet["nics"] and network.gpus_per_node == 8
