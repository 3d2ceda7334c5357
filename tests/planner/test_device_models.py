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
* H200: "NVIDIA H200 Tensor Core GPU" (SXM, https://www.nvidia.com/en-us/data-center/h200/): FP32 67
  TFLOPS, TF32 Tensor Core 989 TFLOPS with sparsity (494.5 dense), BFLOAT16/FP16 1,979 with sparsity
  (989.5 dense), GPU memory 141 GB at 4.8 TB/s; NVLink 900 GB/s.
* Nodes: DGX-1 4 × 100 Gb/s InfiniBand, DGX A100 8 × 200 Gb/s, DGX H100 and DGX H200 8 × 400 Gb/s.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from deeppool.model.graph import Layer
from deeppool.planner.hardware import DEVICES, GIB, H200_HOST_BWD_OP_S, H200_HOST_FWD_OP_S, NETWORKS, KnownDevice
from deeppool.planner.profiling.profile import estimate_ms
from deeppool.plans import Precision

REPO = Path(__file__).resolve().parents[2]

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
    KnownDevice.H200: {"fp32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5, "bandwidth": 4800.0,
                       "memory_gb": 141 * 1e9 / GIB, "nvlink_one_way": 450.0, "nic": 400 / 8, "nics": 8},
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


def _layer(op: str, flops: float, nodes: int = 1) -> Layer:
    names = tuple(f"n{i}" for i in range(nodes - 1)) + ("layer",)
    return Layer(name="layer", op=op, target="layer", nodes=names, inputs=("x",), output_shape=(1,), dtype="float32",
                 params=(), param_bytes=0, act_bytes=4, fwd_flops=flops, bwd_flops=2 * flops)


def test_fp32_convolutions_run_at_the_tf32_peak_and_matmuls_only_when_enabled() -> None:
    """PyTorch's defaults: cudnn.allow_tf32 True, cuda.matmul.allow_tf32 False."""
    h100 = DEVICES[KnownDevice.H100]
    conv, linear = _layer("Conv2d", 1e14), _layer("Linear", 1e14)  # compute-bound, the launch negligible
    tf32 = h100.peak(Precision.TF32) / h100.peak(Precision.FP32)
    fp32_conv = estimate_ms(conv, 1, replace(h100, tf32_convolutions=False), Precision.FP32)[0]
    assert fp32_conv / estimate_ms(conv, 1, h100, Precision.FP32)[0] == pytest.approx(tf32, rel=1e-3)
    assert estimate_ms(linear, 1, h100, Precision.FP32) == estimate_ms(linear, 1, replace(h100, tf32_convolutions=False),
                                                                       Precision.FP32)
    matmul_tf32 = estimate_ms(linear, 1, replace(h100, tf32_matmuls=True), Precision.FP32)[0]
    assert estimate_ms(linear, 1, h100, Precision.FP32)[0] / matmul_tf32 == pytest.approx(tf32, rel=1e-3)
    assert estimate_ms(conv, 1, h100, Precision.BF16) == estimate_ms(conv, 1, replace(h100, tf32_convolutions=False),
                                                                     Precision.BF16)


def test_the_host_floor_per_operator_bounds_a_small_layer_from_below() -> None:
    h200 = DEVICES[KnownDevice.H200]
    tiny, big = _layer("relu", 0.0, nodes=3), _layer("Conv2d", 1e13, nodes=3)
    assert estimate_ms(tiny, 1, h200, Precision.FP32)[0] == pytest.approx(3 * 1e3 * H200_HOST_FWD_OP_S)
    assert estimate_ms(big, 1, h200, Precision.FP32)[0] > 3 * 1e3 * H200_HOST_FWD_OP_S  # the device's time
    assert estimate_ms(tiny, 1, replace(h200, host_fwd_op_s=0.0), Precision.FP32)[0] < 0.01


@pytest.mark.heavy
def test_the_h200_host_floor_is_the_fit_to_the_recorded_profiles() -> None:
    done = subprocess.run([sys.executable, "benchmarks/gpu_model.py", "--node-floor"], cwd=REPO, capture_output=True,
                          text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    fit = json.loads(done.stdout.strip().splitlines()[-1])
    assert 1e3 * H200_HOST_FWD_OP_S == pytest.approx(fit["fwd_node_ms"], rel=0.01)
    assert 1e3 * H200_HOST_BWD_OP_S == pytest.approx(fit["bwd_node_ms"], abs=1e-4)
