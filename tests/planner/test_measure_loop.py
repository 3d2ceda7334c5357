"""Issue 23: a local plan rests on measured per-GPU batches, a cache that records its conditions and re-measures
what a busy machine measured, and a confidence per stage. Real profiler runs on a tiny MLP, on the CPU."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from deeppool.model.loading import load_model
from deeppool.model.trace import trace
from deeppool.plans import ModelSpec, Plan, Strategy
from deeppool.planner.api import CostSource, PlanRequest, local_profiler, plan_graph, plan_model
from deeppool.planner.hardware import NETWORKS, KnownDevice
from deeppool.planner.measure_loop import first_batches, plan_on_measured, used_batches
from deeppool.planner.profiling.cache import CACHE_FILE, ProfileCache, clear_cache, layer_code
from deeppool.planner.profiling.fitting import layer_times
from deeppool.planner.profiling.profile import FitQuality, LayerTimes
from deeppool.planner.profiling.profiler import LayerProfiler, ProfilerConfig, measure_profile
from deeppool.planner.profiling.sharing import sharing_counts
from deeppool.planner.profiling.stats import Measured
from deeppool.planner.report import evidence_lines, plan_table, stages, summary
from tests.entry import deeppool
from tests.planner import synthetic

TINY = Path(__file__).resolve().parents[1] / "models" / "tiny_mlp.py"
FAST = {"warmup": 0, "repeats": 2, "max_repeats": 2, "show_progress": False}


def _used_by(planned) -> set[int]:
    """Every per-GPU batch the written plan and its baselines run."""
    cost = planned.cost
    return {cost.per_gpu_batch(g) for assignment in planned.assignments.values() for g in assignment.values()}


def test_the_plan_and_its_baselines_rest_only_on_measured_batches():
    """24 samples on 4 ranks: the first round measures 2, 4, 8; whatever the plan, data parallel (6 per rank) and
    its best width use is measured before the plan is written, and no layer is extrapolated."""
    planned = plan_model(ModelSpec.parse(str(TINY)), PlanRequest(gpus=4, global_batch=24),
                         CostSource(device_model="local", show_progress=False))
    evidence = planned.plan.evidence
    assert evidence is not None
    assert _used_by(planned) <= set(evidence.measured_batches)
    assert {2, 4, 8, 6} <= set(evidence.measured_batches), "data parallel's 6 per rank was measured, not fitted"
    assert evidence.extrapolated == () and evidence.unmeasured_batches == ()
    assert all(layer.spread >= 0 for layer in planned.plan.layers) and planned.plan.predicted.uncertainty >= 0
    counts = {g for g in planned.plan.assignment.values() if g > 1}
    assert evidence.sharing == {g: planned.cost.profile.sharing(g) for g in counts}
    assert set(planned.cost.profile.measured_sharing) == set(sharing_counts(4))
    assert Plan.from_json(planned.plan.to_json()) == planned.plan


def test_a_cap_stops_the_loop_and_the_plan_names_the_layers_it_extrapolates():
    request = PlanRequest(gpus=2, global_batch=16, strategy=Strategy.DATA_PARALLEL)
    planned = plan_model(ModelSpec.parse(str(TINY)), request,
                         CostSource(device_model="local", show_progress=False, max_measured_batch=4))
    evidence = planned.plan.evidence
    assert evidence is not None and max(evidence.measured_batches) <= 4
    assert set(evidence.extrapolated) == set(planned.cost.graph.names), "data parallel on 2 runs 8 per rank"
    assert 8 in evidence.unmeasured_batches
    lines = evidence_lines(planned.plan)
    assert any("--max-measured-batch" in line and "fc1" in line for line in lines)


def test_a_batch_whose_profiling_pass_would_not_fit_the_memory_is_left_fitted_and_named():
    spec = ModelSpec.parse(str(TINY))
    loaded = load_model(spec)
    traced = trace(loaded)
    per_sample = 3 * sum(layer.act_bytes for layer in traced.graph.layers)
    weights = 4 * sum(layer.param_bytes for layer in traced.graph.layers)
    config = ProfilerConfig(threads=1, memory_budget=weights + 8 * per_sample, **FAST)
    profiler = LayerProfiler(traced, loaded, config)
    assert profiler.fits(8) and not profiler.fits(9)
    request = PlanRequest(gpus=2, global_batch=32, strategy=Strategy.DATA_PARALLEL)
    planned = plan_on_measured(
        profiler, lambda profile: plan_graph(traced.graph, profile, NETWORKS[KnownDevice.A100], request, model=spec),
        targets=(16, 32), cap=None, one_gpu=False)
    assert profiler.batches == (2, 4, 8)
    evidence = planned.plan.evidence
    assert evidence is not None and 16 in evidence.unmeasured_batches and len(evidence.extrapolated) == 5
    assert any("would not fit this machine's memory" in line for line in evidence_lines(planned.plan))


def test_the_loop_measures_each_new_batch_once_and_ends():
    """Driven with the real profiler and planner on the CPU (the same code a --local-device cuda run takes):
    every round adds the batches the last solution used, and the profile's time at a measured batch is the
    measured median."""
    spec = ModelSpec.parse(str(TINY))
    loaded = load_model(spec)
    traced = trace(loaded)
    request = PlanRequest(gpus=3, global_batch=12)
    config = ProfilerConfig(threads=1, ranks=3, **FAST)
    profiler = LayerProfiler(traced, loaded, config)
    rounds: list[tuple[int, ...]] = []

    def solve(profile):
        rounds.append(profiler.batches)
        return plan_graph(traced.graph, profile, NETWORKS[KnownDevice.A100], request, model=spec)

    planned = plan_on_measured(profiler, solve, targets=(4, 6, 12), cap=None, one_gpu=True)
    assert rounds[0] == first_batches(None, 12) == (2, 4, 8)
    assert len(rounds) == len(set(rounds)), "no round repeats the last: each measures something new"
    assert 12 in profiler.batches, "with an amplification reference, the one-GPU batch is measured"
    assert set(used_batches(planned.cost, planned.assignments, one_gpu=True)) <= set(profiler.batches)
    profile = planned.cost.profile
    for name in traced.graph.names:  # the largest batch is never raised: nothing larger sets a rate for it
        measured = profiler.measured[name][12]
        if measured.fwd_ms + measured.bwd_ms >= 0.05:
            assert profile.times(name, 12) == pytest.approx((measured.fwd_ms, measured.bwd_ms), rel=1e-12)


def test_the_local_profiler_measures_on_the_device_the_source_names():
    loaded = load_model(ModelSpec.parse(str(TINY)))
    traced = trace(loaded)
    profiler = local_profiler(CostSource(device_model="local", local_device="cpu", show_progress=False), traced,
                              loaded, PlanRequest(gpus=2, global_batch=8))
    assert profiler.device == torch.device("cpu") and profiler.config.threads is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_loop_on_cuda_is_the_same_code():
    planned = plan_model(ModelSpec.parse(str(TINY)), PlanRequest(gpus=4, global_batch=24),
                         CostSource(device_model="local", local_device="cuda", show_progress=False))
    assert planned.plan.evidence is not None and _used_by(planned) <= set(planned.plan.evidence.measured_batches)
    assert "cpu" not in planned.plan.device


def test_measured_times_are_kept_at_measured_batches_and_gpu_time_never_shrinks():
    samples = [Measured(fwd_ms=f, bwd_ms=2 * f, spread=s) for f, s in ((1.0, 0.02), (1.5, 0.3), (8.0, 0.05))]
    times, _ = layer_times((2, 4, 16), samples, (2, 4, 8, 16), lambda m: m.spread > 0.1)
    assert times.at(16) == (8.0, 16.0), "the measured median, not the line"
    assert times.at(2) == (1.0, 2.0)
    assert 2 * sum(times.at(8)) >= sum(times.at(16)) - 1e-9
    assert 4 * sum(times.at(4)) >= sum(times.at(16)) - 1e-9, "4's noisy-low time is raised to 16's rate"
    assert times.spread == (0.02, 0.3, 0.3, 0.05), "a fitted batch has its nearest measured one's spread"
    assert times.busy == (False, True, True, False)


def test_cached_times_record_their_conditions_and_busy_ones_are_remeasured_when_quieter(tmp_path):
    loaded = load_model(ModelSpec.parse(str(TINY)))
    traced = trace(loaded)
    busy = ProfilerConfig(batches=(2,), cache_dir=tmp_path, load=lambda: 9.0, cores=2, reference=lambda: 10.0,
                          **FAST)
    first = measure_profile(traced, loaded, busy)
    entries = ProfileCache(tmp_path).entries
    assert entries and all(e["load"] == 9.0 and e["cores"] == 2 and e["torch"] == torch.__version__
                           and e["device"].startswith("cpu") and "threads" in e for e in entries.values())
    assert all(all(times.busy) for times in first.layers.values()), "load 9 on 2 cores: every time is flagged"
    assert first.conditions is not None and first.conditions.busy

    still_busy = replace(busy, load=lambda: 5.0)
    again = measure_profile(traced, loaded, still_busy)
    assert again.layers == first.layers, "not quieter: reused, and still flagged"
    assert all(e["load"] == 9.0 for e in ProfileCache(tmp_path).entries.values())

    quiet = replace(busy, load=lambda: 0.5)
    remeasured = measure_profile(traced, loaded, quiet)
    assert all(e["load"] == 0.5 for e in ProfileCache(tmp_path).entries.values()), "measured again, quietly"
    assert not any(remeasured.layers["fc1"].busy) or remeasured.layers["fc1"].spread[0] > quiet.spread_bound


def test_a_plan_names_the_layers_resting_on_busy_measurements(tmp_path):
    spec = ModelSpec.parse(str(TINY))
    loaded = load_model(spec)
    traced = trace(loaded)
    config = ProfilerConfig(load=lambda: 7.0, cores=2, threads=1, **FAST)
    request = PlanRequest(gpus=2, global_batch=8)
    planned = plan_on_measured(
        LayerProfiler(traced, loaded, config),
        lambda profile: plan_graph(traced.graph, profile, NETWORKS[KnownDevice.A100], request, model=spec),
        targets=(4, 8), cap=None, one_gpu=False)
    evidence = planned.plan.evidence
    assert evidence is not None and set(evidence.busy) == set(traced.graph.names) and evidence.load == 7.0
    assert any("busy machine (load up to 7.0 on 2 cores)" in line for line in evidence_lines(planned.plan))


def test_the_cache_key_covers_model_code_input_shape_and_dtype(tmp_path):
    def write(name: str, body: str) -> ModelSpec:
        path = tmp_path / f"{name}.py"
        path.write_text(
            "import torch\nfrom torch import nn\n\n"
            "class Net(nn.Module):\n"
            "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(8, 8)\n\n"
            f"    def forward(self, x):\n        return {body}\n\n"
            "def model():\n    return Net()\n\n"
            "def inputs(batch_size):\n    return (torch.randn(batch_size, 8),)\n")
        return ModelSpec.parse(str(path))

    codes = []
    for name, body in (("twice", "self.fc(x) * 2"), ("thrice", "self.fc(x) * 3")):
        traced = trace(load_model(write(name, body)))
        codes.append(layer_code(traced.module, traced.graph.layers[-1]))
    assert codes[0] != codes[1], "a changed constant in forward changes the layer's code"

    config = ProfilerConfig(batches=(2,), cache_dir=tmp_path / "cache", **FAST)
    loaded = load_model(write("twice", "self.fc(x) * 2"))
    measure_profile(trace(loaded), loaded, config)
    count = len(ProfileCache(tmp_path / "cache").entries)
    loaded = load_model(write("thrice", "self.fc(x) * 3"))
    measure_profile(trace(loaded), loaded, config)
    assert len(ProfileCache(tmp_path / "cache").entries) > count, "the changed model was measured, not read"
    count = len(ProfileCache(tmp_path / "cache").entries)
    loaded = load_model(write("thrice", "self.fc(x) * 3"))
    loaded.module.double()
    double = replace(loaded, inputs=lambda b: (torch.randn(b, 8, dtype=torch.float64),))
    measure_profile(trace(double), double, config)
    assert len(ProfileCache(tmp_path / "cache").entries) > count, "another dtype is measured, not read"


def test_an_old_cache_without_conditions_is_not_read_and_the_cache_clears(tmp_path):
    (tmp_path / CACHE_FILE).write_text(json.dumps({"somekey": [1.0, 2.0, 0.01]}))
    assert ProfileCache(tmp_path).get("somekey") is None
    cache = ProfileCache(tmp_path)
    cache.put("k", Measured(fwd_ms=1.0, bwd_ms=2.0, spread=0.0, load=0.3), {"cores": 2})
    cache.save()
    assert ProfileCache(tmp_path).get("k") == Measured(fwd_ms=1.0, bwd_ms=2.0, spread=0.0, load=0.3)
    assert clear_cache(tmp_path) == 1 and not (tmp_path / CACHE_FILE).exists()
    assert clear_cache(tmp_path) == 0


def _synthetic_plan(spread: float):
    graph = synthetic.graph([("a", ("x",), 4_000, 4_000), ("b", ("a",), 40_000, 4_000)])
    profile = synthetic.profile(graph, {"a": 0.5, "b": 0.2}, 0.1, (1, 2, 4, 8))
    fit = FitQuality(measured_batches=(1, 2, 4, 8), error_p50=0.0, error_p90=0.0, noisy=0, measurements=8,
                     spread_bound=0.1, compared=8)
    profile = replace(profile, source="measured", fit=fit, layers={
        name: LayerTimes(batches=t.batches, fwd_ms=t.fwd_ms, bwd_ms=t.bwd_ms, spread=(spread,) * 4)
        for name, t in profile.layers.items()})
    spec = ModelSpec.parse(str(TINY))
    return plan_graph(graph, profile, NETWORKS[KnownDevice.A100], PlanRequest(gpus=4, global_batch=8), model=spec).plan


def test_each_stage_carries_its_spread_and_a_weak_prediction_says_so():
    steady, shaky = _synthetic_plan(0.04), _synthetic_plan(0.3)
    assert all(stage.spread == pytest.approx(0.04) for stage in stages(steady))
    assert 0 < steady.predicted.uncertainty <= 0.04 + 1e-9
    assert "weak prediction" not in summary(steady)
    assert shaky.predicted.uncertainty > 0.15
    assert "weak prediction: the iteration is uncertain by ±" in summary(shaky)
    assert all(layer.spread == pytest.approx(0.3) for layer in shaky.layers)
    assert Plan.from_json(shaky.to_json()).predicted.uncertainty == shaky.predicted.uncertainty
    assert plan_table(steady).columns[-1].header == "± spread"
    assert steady.evidence is not None and steady.evidence.busy == () and steady.evidence.extrapolated == ()


def test_profile_clear_cache_and_no_cache_from_the_command_line(capsys, tmp_path):
    cache = tmp_path / "cache"
    made = deeppool(capsys, "profile", str(TINY), "--out", str(tmp_path / "a.json"), "--batches", "2",
                    "--repeats", "1", "--warmup", "0", "--cache-dir", str(cache))
    assert made.code == 0, made.stderr
    assert (cache / CACHE_FILE).is_file()
    cleared = deeppool(capsys, "profile", "--clear-cache", "--cache-dir", str(cache))
    assert cleared.code == 0, cleared.stderr
    assert "removed" in cleared.stdout and not (cache / CACHE_FILE).exists()
    fresh = deeppool(capsys, "profile", str(TINY), "--out", str(tmp_path / "b.json"), "--batches", "2",
                     "--repeats", "1", "--warmup", "0", "--cache-dir", str(cache), "--no-cache")
    assert fresh.code == 0, fresh.stderr
    assert not (cache / CACHE_FILE).exists(), "--no-cache writes no cache"
    planned = deeppool(capsys, "plan", str(TINY), "--gpus", "2", "--batch", "4", "--cache-dir", str(cache),
                       "--no-cache", "--network", "local", "--out", str(tmp_path / "p.json"))
    assert planned.code == 0, planned.stderr
    assert not (cache / CACHE_FILE).exists() and "± spread" in planned.stdout
    evidence = json.loads((tmp_path / "p.json").read_text())["evidence"]
    assert {2, 4} <= set(evidence["measured_batches"])
    refused = deeppool(capsys, "profile", "--cache-dir", str(cache))
    assert refused.code == 2 and refused.stderr.startswith("error:") and "MODEL" in refused.stderr


POOLED = TINY.parent / "pooled_batchnorm.py"


def test_a_batch_some_layer_cannot_run_at_alone_is_left_fitted_not_a_traceback():
    """BatchNorm on a 1x1 map cannot train on one sample (the executor runs it over the layer's whole batch,
    so counts giving one sample per GPU stay allowed): batch 1 is fitted, named among the unmeasured."""
    spec = ModelSpec.parse(str(POOLED))
    loaded = load_model(spec)
    traced = trace(loaded)
    profiler = LayerProfiler(traced, loaded, ProfilerConfig(threads=1, **FAST))
    request = PlanRequest(gpus=4, global_batch=4, strategy=Strategy.DATA_PARALLEL)
    planned = plan_on_measured(
        profiler, lambda profile: plan_graph(traced.graph, profile, NETWORKS[KnownDevice.A100], request, model=spec),
        targets=(1, 2, 4), cap=None, one_gpu=False)
    assert profiler.batches == (2, 4)
    evidence = planned.plan.evidence
    assert evidence is not None and evidence.unmeasured_batches == (1,)
    assert any("cannot run there alone" in line for line in evidence_lines(planned.plan))


def test_a_model_no_measurable_batch_runs_is_one_error_line_naming_the_layer_and_op(tmp_path, capfd):
    result = deeppool(capfd, "plan", str(POOLED), "--gpus", "4", "--batch", "4", "--max-measured-batch", "1",
                      "--no-cache", "--network", "local", "--out", str(tmp_path / "plan.json"))
    assert result.code == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "at per-GPU batch 1" in lines[0] and "op norm raised ValueError" in lines[0], lines[0]
    assert not (tmp_path / "plan.json").exists()


def test_another_op_that_fails_at_a_measured_batch_is_one_error_line_not_a_fitted_batch(tmp_path, capfd):
    """Only BatchNorm is run over the layer's whole batch by the executor; a plan may not use a batch at which any
    other op fails, so measuring it there is the error (the model fails eagerly at that batch too)."""
    result = deeppool(capfd, "plan", str(TINY.parent / "squeezed.py"), "--gpus", "2", "--batch", "4",
                      "--max-measured-batch", "2", "--no-cache", "--network", "local", "--out", str(tmp_path / "plan.json"))
    assert result.code == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: layer 'unsqueeze'"), lines
    assert "at per-GPU batch 1: op unsqueeze raised IndexError" in lines[0], lines[0]
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize("batch", [2, pytest.param(4, marks=pytest.mark.heavy)])
def test_run_refuses_a_device_model_plan_whose_per_gpu_batch_breaks_an_op_in_one_line(tmp_path, capfd, batch):
    """A device model measures nothing, so its plan may give a layer a batch its ops cannot run: ``run`` probes
    that batch before any rank starts (at global batch 4 each rank gets 2 samples, which the op runs)."""
    plan = tmp_path / "plan.json"
    made = deeppool(capfd, "plan", str(TINY.parent / "squeezed.py"), "--gpus", "2", "--batch", str(batch),
                    "--device-model", "a100", "--strategy", "dp", "--out", str(plan))
    assert made.code == 0, made.stderr[-2000:]
    result = deeppool(capfd, "run", str(plan), "--nproc", "2", "--steps", "1", "--out", str(tmp_path / "run"))
    if batch == 4:
        assert result.code == 0, result.stderr[-3000:]
        return
    assert result.code != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: layer 'unsqueeze'"), lines
    assert "the plan gives it per-GPU batch 1" in lines[0], lines[0]


def test_a_noisy_cached_batch_is_measured_again_and_the_steadier_measurement_kept(tmp_path):
    """A noisy measurement is not kept just because the load is what it was: the batch is measured again when
    the machine is not busy, and of the two the steadier one stays in the cache."""
    loaded = load_model(ModelSpec.parse(str(TINY)))
    traced = trace(loaded)
    config = ProfilerConfig(batches=(2,), cache_dir=tmp_path, load=lambda: 1.0, cores=2, warmup=1, repeats=3,
                            show_progress=False, reference=lambda: 10.0)
    measure_profile(traced, loaded, config)
    layer_keys = [key for key, entry in ProfileCache(tmp_path).entries.items()
                  if entry["fwd_ms"] + entry["bwd_ms"] >= 0.05]

    def cache_with_spread(spread: float) -> dict[str, dict[str, object]]:
        cache = ProfileCache(tmp_path)
        for key in layer_keys:
            cache.entries[key]["spread"] = spread
        cache.save()
        return ProfileCache(tmp_path).entries

    noisy = cache_with_spread(5.0)  # a median absolute deviation five times the median: a draw gone wrong
    assert config.remeasure(ProfileCache(tmp_path).get(key) for key in noisy), "not busy: measured again"
    assert not replace(config, load=lambda: 5.0).remeasure(ProfileCache(tmp_path).get(key) for key in noisy)
    measure_profile(traced, loaded, config)
    after = ProfileCache(tmp_path).entries
    assert all(after[key]["at"] != noisy[key]["at"] and after[key]["spread"] < 5.0 for key in layer_keys), \
        "the steadier new draw replaced the noisy one"

    noisy = cache_with_spread(0.2)
    loads = iter([1.0])  # not busy when the cache is read, then busy while the batch is measured again
    busy_after = replace(config, load=lambda: next(loads, 9.0))
    measure_profile(traced, loaded, busy_after)
    after = ProfileCache(tmp_path).entries
    assert all(after[key]["at"] == noisy[key]["at"] for key in layer_keys), "the calmer cached draw is kept"


def test_a_batch_measured_while_the_host_slowed_is_untrusted_and_one_from_another_speed_is_measured_again(tmp_path):
    """A shared host's speed moves without its load showing it: the reference work's time, read before and
    after each batch, flags a batch during which it moved, and a cached batch whose reference differs from
    the host's now is measured again and the new times kept."""
    loaded = load_model(ModelSpec.parse(str(TINY)))
    traced = trace(loaded)
    readings = iter([10.0, 16.0])  # the host slowed by 60% while the batch was measured (no spread is noisy here)
    slowing = ProfilerConfig(batches=(2,), cache_dir=tmp_path, load=lambda: 0.5, cores=2, retries=0,
                             reference=lambda: next(readings, 16.0), spread_bound=1e9, **FAST)
    first = measure_profile(traced, loaded, slowing)
    entries = ProfileCache(tmp_path).entries
    assert all(e["reference_ms"] == 13.0 for e in entries.values()), "the mean of the readings around it"
    assert sum(e["speed_change"] == 0.6 for e in entries.values()) == len(entries) - 1, \
        "every layer and the whole pass moved 60%; the loss, timed after, has its batch's reference"
    assert all(all(times.busy) for times in first.layers.values()), "the speed moved: every time is flagged"

    steady = replace(slowing, reference=lambda: 10.0)
    again = measure_profile(traced, loaded, steady)
    after = ProfileCache(tmp_path).entries
    assert all(e["reference_ms"] == 10.0 and e["speed_change"] == 0.0 for e in after.values()), "measured again"
    assert not any(any(times.busy) for times in again.layers.values()), "at one speed: trusted"

    assert not steady.remeasure([ProfileCache(tmp_path).get(key) for key in after], 10.9), "within 10%: reused"
    assert steady.remeasure([ProfileCache(tmp_path).get(key) for key in after], 11.2), "12% slower now: measured again"
    assert steady.remeasure([ProfileCache(tmp_path).get(key) for key in after], 13.0), "30% slower now: measured again"
    assert not replace(steady, load=lambda: 9.0).remeasure([ProfileCache(tmp_path).get(key) for key in after], 13.0)
    faster = replace(steady, reference=lambda: 6.0)
    measure_profile(traced, loaded, faster)
    assert all(e["reference_ms"] == 6.0 for e in ProfileCache(tmp_path).entries.values()), \
        "a faster host: the new times are kept, steadier or not"


def test_a_batch_measured_while_the_host_slowed_is_measured_again_at_once_and_the_steady_attempt_kept(tmp_path):
    """The speed moved under the first attempt and held under the second: the plan rests on the second, unflagged."""
    loaded = load_model(ModelSpec.parse(str(TINY)))
    traced = trace(loaded)
    readings = iter([10.0, 16.0])  # moved 60% under the first attempt, then steady at 16
    config = ProfilerConfig(batches=(2,), cache_dir=tmp_path, load=lambda: 0.5, cores=2,
                            reference=lambda: next(readings, 16.0), spread_bound=1e9, **FAST)
    profile = measure_profile(traced, loaded, config)
    assert not any(any(times.busy) for times in profile.layers.values()), "the steady attempt was kept"
    entries = ProfileCache(tmp_path).entries
    assert all(e["reference_ms"] == 16.0 and e["speed_change"] == 0.0 for e in entries.values())


@pytest.mark.parametrize("retries", [0, 1, 2])
def test_a_host_whose_speed_keeps_moving_is_measured_retries_more_times_and_stays_flagged(tmp_path, retries):
    loaded = load_model(ModelSpec.parse(str(TINY)))
    traced = trace(loaded)
    speeds = iter(float(10 + 6 * (i % 2)) for i in range(1000))  # 10, 16, 10, 16: every attempt moved 60%
    reads: list[float] = []
    config = ProfilerConfig(batches=(2,), cache_dir=None, load=lambda: 0.5, cores=2, retries=retries,
                            reference=lambda: reads.append(next(speeds)) or reads[-1], spread_bound=1e9, **FAST)
    profile = measure_profile(traced, loaded, config)
    assert all(all(times.busy) for times in profile.layers.values()), "no attempt was steady: flagged"
    assert len(reads) == 2 * (1 + retries), "two readings per attempt"


def test_no_retry_while_the_machine_is_busy(tmp_path):
    loaded = load_model(ModelSpec.parse(str(TINY)))
    traced = trace(loaded)
    speeds = iter(float(10 + 6 * (i % 2)) for i in range(1000))
    reads: list[float] = []
    config = ProfilerConfig(batches=(2,), cache_dir=None, load=lambda: 9.0, cores=2,
                            reference=lambda: reads.append(next(speeds)) or reads[-1], spread_bound=1e9, **FAST)
    measure_profile(traced, loaded, config)
    assert len(reads) == 2, "a busy machine: measuring again now would meet the same load"
