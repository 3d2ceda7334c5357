"""The network probe: fitting the cost model's latency and bandwidth, the network file, planning with it."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest

from deeppool.errors import DeeppoolError
from deeppool.model.loading import load_model
from deeppool.model.trace import trace
from deeppool.plans import ModelSpec, NetworkModel
from deeppool.planner.api import CostSource
from deeppool.planner.hardware import DEVICES, KnownDevice
from deeppool.planner.profiling.netprobe import (
    NetworkFit,
    Pattern,
    Sample,
    fit,
    local_network,
    measure_network,
    probe_network,
)
from deeppool.planner.profiling.netprobe_config import ProbeConfig
from deeppool.planner.profiling.profile import estimated_profile
from deeppool.planner.request import probed_source
from deeppool.planner.solve.cost import CostModel
from tests.executor.plans import model_path

ALPHA, BW = 80e-6, 2e9


def exact(pattern: Pattern, ranks: int, nbytes: int) -> Sample:
    """A sample that follows the cost model's formula with ALPHA and BW exactly."""
    if pattern is Pattern.P2P:
        seconds = ALPHA + nbytes / BW
    else:
        seconds = 2 * (ranks - 1) / ranks * nbytes / BW + 2 * math.ceil(math.log2(ranks)) * ALPHA
    return Sample(pattern=pattern, ranks=ranks, nbytes=nbytes, seconds=seconds)


def synthetic(config: ProbeConfig) -> list[Sample]:
    samples = []
    for nbytes in config.sizes:
        samples.append(exact(Pattern.P2P, 2, nbytes))
        samples += [exact(Pattern.ALLREDUCE, g, nbytes) for g in range(2, config.nproc + 1)]
    return samples


def test_the_fit_recovers_latency_and_bandwidth_of_the_cost_models_formulas() -> None:
    fitted = probe_network(ProbeConfig(nproc=4, sizes=(4096, 2**20, 2**24)), launcher=synthetic)
    assert fitted.latency_s == pytest.approx(ALPHA, rel=1e-9)
    assert fitted.bandwidth == pytest.approx(BW, rel=1e-9)
    assert all(fitted.predict(s) == pytest.approx(s.seconds, rel=1e-9) for s in fitted.samples)


def test_a_latency_the_data_cannot_support_is_clamped_at_zero() -> None:
    samples = [Sample(pattern=Pattern.P2P, ranks=2, nbytes=n, seconds=n / BW * (0.5 if n < 10**5 else 1.0))
               for n in (4096, 65536, 2**20, 2**24)]
    fitted = fit(samples, nproc=2)
    assert fitted.latency_s == 0.0 and fitted.bandwidth > 0


def test_the_network_file_round_trips_and_plans_with_it(tmp_path: Path) -> None:
    fitted = probe_network(ProbeConfig(nproc=2), launcher=synthetic)
    path = tmp_path / "net.json"
    fitted.save(path)
    payload = json.loads(path.read_text())
    assert payload["artifact"] == "network" and payload["schema_version"] == 1
    assert len(payload["measured"]["samples"]) == len(fitted.samples)
    loaded = NetworkModel.load(path)
    assert loaded == fitted.network
    assert loaded.intra_latency_s == pytest.approx(ALPHA) and loaded.intra_bandwidth == pytest.approx(BW)

    graph = trace(load_model(ModelSpec.parse(model_path("mlp")))).graph
    profile = estimated_profile(graph, DEVICES[KnownDevice.A100], (1, 2))
    source = CostSource(device_model="a100", network_file=path, intra_gbps=1.0, inter_gbps=1.0)
    network = source.network_model(profile)
    assert network.intra_bandwidth == 1e9 and network.intra_latency_s == pytest.approx(ALPHA)  # overrides apply
    cost = CostModel(graph=graph, profile=profile, network=loaded, global_batch=4, bucket_bytes=0)
    layer = next(layer for layer in graph.layers if layer.param_bytes)
    copy = 4 * layer.param_bytes / profile.memory_bandwidth  # into the bucket and back (weight and bias)
    expected = 2 * 0.5 * layer.param_bytes / BW + 2 * ALPHA + copy
    assert cost.allreduce_ms(layer, 2) == pytest.approx(1e3 * expected)


def test_the_sync_latency_is_what_rank_0_waits_for_ranks_that_computed_with_it(tmp_path: Path) -> None:
    def with_sync(config: ProbeConfig) -> list[Sample]:
        plain = exact(Pattern.P2P, 2, min(config.sizes))
        return [*synthetic(config), *(Sample(pattern=Pattern.WAKEUP, ranks=g, nbytes=plain.nbytes,
                                             seconds=plain.seconds + 3e-3 * (g - 1)) for g in (2, 3, 4))]

    fitted = probe_network(ProbeConfig(nproc=4, sizes=(4096, 2**20)), launcher=with_sync)
    assert fitted.latency_s == pytest.approx(ALPHA, rel=1e-9), "synchronisation samples stay out of the fit"
    assert fitted.network.wakeup_s == pytest.approx(3e-3)
    assert fitted.network.sync_s == pytest.approx({2: 3e-3, 3: 6e-3, 4: 9e-3})
    assert all(fitted.predict(s) == pytest.approx(s.seconds) for s in fitted.samples if s.pattern is Pattern.WAKEUP)
    path = tmp_path / "net.json"
    fitted.save(path)
    loaded = replace(NetworkModel.load(path), sync_s={2: 6e-3})
    assert NetworkModel.load(path).sync_s == fitted.network.sync_s, "the file keeps every rank count"
    assert loaded.sync_latency_s(8) == pytest.approx(6e-3) and loaded.sync_latency_s(1) == 0.0
    assert probe_network(ProbeConfig(nproc=2), launcher=synthetic).network.wakeup_s == 0.0

    graph = trace(load_model(ModelSpec.parse(model_path("mlp")))).graph
    profile = estimated_profile(graph, DEVICES[KnownDevice.A100], (1, 2))
    cost = CostModel(graph=graph, profile=profile, network=loaded, global_batch=4)
    still = CostModel(graph=graph, profile=profile, network=replace(loaded, wakeup_s=0.0, sync_s={}), global_batch=4)
    layer = graph.layers[0]
    assert cost.reshard_ms(layer, 2, 1) == pytest.approx(still.reshard_ms(layer, 2, 1) + 6.0), "sent by a 2-rank stage"
    assert cost.reshard_ms(layer, 1, 2) == pytest.approx(still.reshard_ms(layer, 1, 2)), "sent by one rank"
    assert cost.round_trip_ms(layer, 1, 4) == pytest.approx(still.round_trip_ms(layer, 1, 4) + 6.0)
    assert cost.round_trip_ms(layer, 2, 4) == pytest.approx(still.round_trip_ms(layer, 2, 4) + 12.0)
    assert cost.reshard_ms(layer, 2, 2) == 0
    with pytest.raises(DeeppoolError, match="wake-up latency"):
        replace(loaded, wakeup_s=-1.0)
    with pytest.raises(DeeppoolError, match="2 or more ranks"):
        replace(loaded, sync_s={1: 1e-3})


def test_the_skew_is_the_wait_that_grows_with_the_compute_before_a_collective(tmp_path: Path) -> None:
    """All-reduces after 10 ms of compute, and after 30 ms taking 2 ms (2 ranks) and 8 ms (4 ranks) longer:
    slopes of 0.1 and 0.4, charged once per rank group on its compute past the probe's 10 ms."""
    def with_skew(config: ProbeConfig) -> list[Sample]:
        usual = [replace(s, busy_s=0.01) for s in synthetic(config)]
        longer = [replace(s, pattern=Pattern.SKEW, busy_s=0.03, seconds=s.seconds + {2: 2e-3, 4: 8e-3}[s.ranks])
                  for s in usual if s.pattern is Pattern.ALLREDUCE and s.ranks in (2, 4)]
        return usual + longer

    fitted = probe_network(ProbeConfig(nproc=4, sizes=(4096, 2**20)), launcher=with_skew)
    assert fitted.latency_s == pytest.approx(ALPHA, rel=1e-9), "skew samples stay out of the fit"
    network = fitted.network
    assert network.skew == pytest.approx({2: 0.1, 4: 0.4}) and network.skew_after_s == pytest.approx(0.01)
    assert network.skew_per_s(3) == pytest.approx(0.1) and network.skew_per_s(8) == pytest.approx(0.4)
    assert network.skew_per_s(1) == 0.0
    assert all(fitted.predict(s) == pytest.approx(s.seconds) for s in fitted.samples if s.pattern is Pattern.SKEW)
    path = tmp_path / "net.json"
    fitted.save(path)
    assert NetworkModel.load(path) == network
    with pytest.raises(DeeppoolError, match="skew"):
        replace(network, skew={1: 0.1})

    graph = trace(load_model(ModelSpec.parse(model_path("mlp")))).graph
    profile = estimated_profile(graph, DEVICES[KnownDevice.A100], (1, 2, 4))
    early = replace(network, skew_after_s=0.0)  # the estimated layers take microseconds, under the probe's 10 ms
    cost = CostModel(graph=graph, profile=profile, network=early, global_batch=4)
    still = CostModel(graph=graph, profile=profile, network=replace(early, skew={}), global_batch=4)
    for g in (2, 4):
        everywhere = dict.fromkeys(graph.names, g)
        extra = early.skew_per_s(g) * sum(sum(cost.compute_ms(layer, g)) for layer in graph.layers)
        assert extra > 0
        assert cost.iteration_ms(everywhere) == pytest.approx(still.iteration_ms(everywhere) + extra)
    assert cost.iteration_ms(dict.fromkeys(graph.names, 1)) == still.iteration_ms(dict.fromkeys(graph.names, 1))
    late = CostModel(graph=graph, profile=profile, network=network, global_batch=4)
    assert late.skew_ms(2, 25.0) == pytest.approx(1.5) and late.skew_ms(2, 5.0) == 0.0


def test_a_local_plans_network_is_measured_once_per_host_and_rank_count_then_read_from_the_cache(
        tmp_path: Path) -> None:
    probes: list[int] = []

    def counted(config: ProbeConfig) -> list[Sample]:
        probes.append(config.nproc)
        return synthetic(config)

    first = local_network(2, tmp_path, launcher=counted)
    assert first.measured_now and first.path == tmp_path / "network-gloo-2.json" and probes == [2]
    again = local_network(2, tmp_path, launcher=counted)
    assert not again.measured_now and again.model == first.model and probes == [2], "read back, not probed"
    assert local_network(3, tmp_path, launcher=counted).measured_now and probes == [2, 3], "another rank count"
    payload = json.loads(first.path.read_text())
    payload["measured"]["host"] = "another-host"
    first.path.write_text(json.dumps(payload))
    assert local_network(2, tmp_path, launcher=counted).measured_now and probes == [2, 3, 2], "another host's"
    first.path.write_text("{ half a file")
    assert local_network(2, tmp_path, launcher=counted).measured_now, "a damaged file is measured again"
    unkept = local_network(2, None, launcher=counted)
    assert unkept.measured_now and unkept.path is None and len(probes) == 5, "no cache: measured, kept nowhere"


def test_only_a_plan_measured_on_this_cpu_for_several_ranks_without_a_network_probes_it_and_only_when_asked(
        tmp_path: Path) -> None:
    said: list[str] = []
    local = CostSource(cache_dir=tmp_path)
    for unchanged, gpus in ((CostSource(device_model="a100"), 4), (replace(local, network="local"), 4), (local, 1)):
        assert probed_source(unchanged, gpus, said.append) == unchanged
    assert said == []
    crowded = (os.cpu_count() or 1) * 4 + 1
    assert probed_source(local, crowded, said.append) == local
    assert len(said) == 1 and "the local preset, not measured" in said[0], said
    probing = probed_source(local, 2, said.append)
    assert probing.measured_network is not None and len(said) == 1
    assert not (tmp_path / "network-gloo-2.json").exists(), "nothing is probed before the planner asks"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "is not valid JSON"),
        ('{"artifact": "plan", "schema_version": 1}', "is not a network JSON"),
        ('{"artifact": "network", "schema_version": 9}', "has schema_version 9"),
        ('{"artifact": "network", "schema_version": 1, "gpus_per_node": 8}', "is incomplete"),
        ('{"artifact": "network", "schema_version": 1, "gpus_per_node": 8, "intra_bandwidth": -1, '
         '"inter_bandwidth": 1, "intra_latency_s": 0, "inter_latency_s": 0}', "bandwidths must be positive"),
    ],
)
def test_a_bad_network_file_is_refused_in_one_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "net.json"
    path.write_text(content)
    with pytest.raises(DeeppoolError, match=message) as err:
        NetworkModel.load(path)
    assert "\n" not in str(err.value)
    with pytest.raises(DeeppoolError, match=message):
        CostSource(device_model="a100", network_file=path)  # refused before any tracing


def test_network_and_network_file_are_exclusive(tmp_path: Path) -> None:
    path = tmp_path / "net.json"
    probe_network(ProbeConfig(nproc=2), launcher=synthetic).save(path)
    with pytest.raises(DeeppoolError, match="either --network or --network-file"):
        CostSource(device_model="a100", network="a100", network_file=path)


def test_probe_config_is_validated() -> None:
    with pytest.raises(DeeppoolError, match="at least 2 processes"):
        ProbeConfig(nproc=1)
    with pytest.raises(DeeppoolError, match="--sizes"):
        ProbeConfig(sizes=())


@pytest.mark.slow
@pytest.mark.heavy
def test_measuring_this_machine_with_two_gloo_processes() -> None:
    """In the heavy tier (10 s): ``test_profile_network_then_plan_with_the_measured_network`` probes this machine
    through the command line in the default run."""
    network = measure_network(2, sizes=(4096, 2**20, 2**22))
    assert isinstance(network, NetworkModel)
    assert 1e6 < network.intra_bandwidth < 1e12 and 0 <= network.intra_latency_s < 0.1
    assert list(network.skew) == [2] and network.skew[2] >= 0 and network.skew_after_s == pytest.approx(0.01)


def test_fit_table_lists_every_sample() -> None:
    from deeppool.executor.launch.report import fit_table

    fitted: NetworkFit = probe_network(ProbeConfig(nproc=3, sizes=(4096, 2**20)), launcher=synthetic)
    assert fit_table(fitted).row_count == 2 * (1 + 2)
