"""Measured profiles: every layer timed at every batch, cached, CUDA-timed on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import deeppool
from deeppool.planner.graph import TraceMethod
from deeppool.planner.hardware import DEVICES, KnownDevice
from deeppool.planner.modelspec import ModelSpec
from deeppool.planner.hardware import Precision
from deeppool.planner.profile import Profile, estimate_ms
from deeppool.planner.profiler import ProfileCache, ProfilerConfig, measure_profile
from deeppool.planner.trace import trace

TINY = Path(__file__).resolve().parents[1] / "models" / "tiny_mlp.py"


def test_measure_then_cache_round_trip(tmp_path):
    loaded = ModelSpec.parse(str(TINY)).load()
    traced = trace(loaded)
    config = ProfilerConfig(batches=(1, 4), warmup=1, repeats=3, cache_dir=tmp_path, show_progress=False)
    first = measure_profile(traced, loaded, config)
    assert set(first.layers) == set(traced.graph.names)
    assert all(len(t.fwd_ms) == 2 and min(t.fwd_ms) > 0 for t in first.layers.values())
    assert first.layers["fc1"].bwd_ms[0] > 0
    assert len(ProfileCache(tmp_path).entries) == 2 * len(traced.graph)
    again = measure_profile(traced, loaded, config)
    assert again.layers == first.layers, "a second profile of the same layers comes from the cache"
    assert first.memory_bandwidth > 1e8
    path = tmp_path / "profile.json"
    first.save(path)
    assert Profile.load(path) == first


def test_interpolation_between_and_beyond_measured_batches():
    profile = Profile.from_json({
        "artifact": "profile", "schema_version": 1, "device": "d", "source": "test", "dtype": "float32",
        "memory_bytes": 1, "memory_bandwidth": 1e9, "layers": {"a": {"batches": [2, 4], "fwd_ms": [1.0, 2.0], "bwd_ms": [2.0, 4.0]}},
    })
    assert profile.times("a", 3) == (1.5, 3.0)
    assert profile.times("a", 8) == (4.0, 8.0)
    assert profile.times("a", 1) == (0.5, 1.0)


def test_device_model_estimates_scale_with_the_device():
    graph = trace(ModelSpec.parse(str(TINY)).load()).graph
    fc1 = graph.layer("fc1")
    v100, h100 = (estimate_ms(fc1, 4096, DEVICES[k], Precision.TF32) for k in (KnownDevice.V100, KnownDevice.H100))
    assert h100[0] < v100[0] and h100[1] < v100[1]
    assert graph.method is TraceMethod.FX


def test_python_api_plans_a_module():
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    plan = deeppool.plan(model, (torch.randn(32, 16),), gpus=8, device_model="a100")
    assert plan.global_batch == 32 and len(plan.layers) == 3
    assert plan.predicted.iteration_ms <= plan.predicted.data_parallel_iteration_ms + 1e-9


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_profile_uses_cuda_events(tmp_path):
    loaded = ModelSpec.parse(str(TINY)).load()
    config = ProfilerConfig(device="cuda", batches=(1, 64), warmup=2, repeats=5, show_progress=False)
    measured = measure_profile(trace(loaded), loaded, config)
    assert not measured.device.startswith("cpu")
    assert all(min(t.fwd_ms) > 0 for t in measured.layers.values())
