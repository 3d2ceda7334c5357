"""``deeppool plan --optimizer kfac``: the plan names the layers K-FAC preconditions, each one's step holds its
statistics, eigendecompositions and preconditioning (priced by FLOPs, or timed on this host), and layers with
large factors go to larger groups."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from deeppool.adaptation.kfac_options import KfacOptions
from deeppool.model.loading import load_model
from deeppool.planner.hardware import DEVICES, NETWORKS, KnownDevice
from deeppool.planner.profiling.kfac_times import KfacLayer, KfacTimes, kfac_layers, measure_kfac
from deeppool.planner.profiling.profile import estimated_profile
from deeppool.planner.solve.cost import CostModel
from deeppool.plans import ModelSpec, Optimizer, Plan
from tests.entry import deeppool
from tests.executor.plans import traced_graph

WIDE = '''
import torch
from torch import nn


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2048), nn.ReLU(), nn.Linear(2048, 2048),
                         nn.ReLU(), nn.Linear(2048, 10))


def inputs(batch_size: int) -> tuple[torch.Tensor]:
    return (torch.randn(batch_size, 64),)
'''


def _plan(capsys, model: Path, optimizer: str) -> tuple[Plan, dict]:
    out = model.parent / f"{optimizer}.json"
    done = deeppool(capsys, "plan", str(model), "--gpus", "8", "--batch", "32", "--device-model", "a100",
                    "--optimizer", optimizer, "--out", str(out))
    assert done.code == 0, done.stderr
    return Plan.load(out), json.loads(out.read_text())


def test_the_plan_names_the_preconditioned_layers_and_gives_large_factors_more_gpus(tmp_path: Path, capsys) -> None:
    model = tmp_path / "wide.py"
    model.write_text(WIDE)
    sgd, sgd_json = _plan(capsys, model, "sgd")
    kfac, kfac_json = _plan(capsys, model, "kfac")
    assert "preconditioned" not in sgd_json and sgd.preconditioned == ()
    linear = tuple(layer.name for layer in kfac.layers if layer.op == "Linear")
    assert kfac.preconditioned == linear and kfac_json["preconditioned"] == list(linear)
    assert kfac.optimizer is Optimizer.KFAC
    square = kfac.layers[4]  # Linear(2048, 2048): factors of 2049² and 2048²
    assert square.op == "Linear" and square.step_ms > 10 * sgd.layers[4].step_ms
    assert square.gpus > sgd.layers[4].gpus
    assert kfac.predicted.iteration_ms > sgd.predicted.iteration_ms


def test_intervals_amortise_and_groups_share_the_inverses(tmp_path: Path) -> None:
    model = tmp_path / "wide.py"
    model.write_text(WIDE)
    graph = traced_graph(str(model))
    device = DEVICES[KnownDevice.A100]
    cost = CostModel(graph=graph, profile=estimated_profile(graph, device, (1, 2, 4, 8, 16, 32)),
                     network=NETWORKS[KnownDevice.A100], global_batch=32, optimizer=Optimizer.KFAC,
                     kfac=KfacOptions(factor_update_steps=1, inv_update_steps=1))
    layer = graph.layers[4]
    rare_inverses = dataclasses.replace(cost, kfac=KfacOptions(factor_update_steps=1, inv_update_steps=4))
    rare_factors = dataclasses.replace(cost, kfac=KfacOptions(factor_update_steps=2, inv_update_steps=1))
    inverses = {g: (cost.kfac_ms(layer, g) - rare_inverses.kfac_ms(layer, g)) * 4 / 3 for g in (1, 2, 4)}
    assert inverses[1] > 0
    for g in (2, 4):
        assert abs(inverses[g] * g - inverses[1]) < 1e-9 * inverses[1]  # spread over the group's ranks
    assert 0 < cost.kfac_ms(layer, 1) - rare_factors.kfac_ms(layer, 1) < cost.kfac_ms(layer, 1)
    sgd = dataclasses.replace(cost, optimizer=Optimizer.SGD)
    assert cost.memory_bytes(layer, 1) - sgd.memory_bytes(layer, 1) == 8 * (2049 ** 2 + 2048 ** 2)
    assert sgd.kfac_ms(layer, 1) == 0 and cost.kfac_ms(graph.layers[3], 1) == 0  # ReLU keeps its plain step


def test_work_timed_on_this_host_replaces_the_flop_price(tmp_path: Path) -> None:
    model = tmp_path / "wide.py"
    model.write_text(WIDE)
    graph = traced_graph(str(model))
    cost = CostModel(graph=graph, profile=estimated_profile(graph, DEVICES[KnownDevice.A100], (1, 2, 4, 8, 16, 32)),
                     network=NETWORKS[KnownDevice.A100], global_batch=32, optimizer=Optimizer.KFAC,
                     kfac=KfacOptions(factor_update_steps=1, inv_update_steps=4))
    sizes = {name: (s.inputs, s.outputs, s.positions) for name, s in cost.preconditioned.items()}
    assert sizes["_2"] == (65, 2048, 1) and sizes["_0"] == (65, 64, 1)
    layers = kfac_layers(graph, ("_0",), load_model(ModelSpec.parse(str(model))).module)
    assert layers["_0"] == KfacLayer(kind="Linear", inputs=64, outputs=64, bias=True, sample_shape=(64,))
    timed = measure_kfac(layers, 32, rounds=1)["_0"]
    assert min(timed.inverses_ms, timed.precondition_ms) > 0 and timed.statistics_ms >= 0
    layer = graph.layers[0]
    zero, unit = (dataclasses.replace(cost, kfac_times={"_0": KfacTimes(
        statistics_ms=v, inverses_ms=v * 4, precondition_ms=v, factor_update_ms=v)}) for v in (0.0, 1.0))
    for g in (1, 2):  # statistics scale with the rank's rows (the factor update does not), the inverses are shared
        assert unit.kfac_ms(layer, g) - zero.kfac_ms(layer, g) == pytest.approx(  # and amortised over 4 steps
            unit.per_gpu_batch(g) / 32 + 1 + 1 / g + 1)
    shared = [dataclasses.replace(c, profile=dataclasses.replace(c.profile, measured_sharing={2: 2.0}))
              for c in (zero, unit)]  # 2 ranks on cores that run one: all but the owner's preconditioning slow down
    assert shared[1].kfac_ms(layer, 2) - shared[0].kfac_ms(layer, 2) == pytest.approx(
        2 * (unit.per_gpu_batch(2) / 32 + 1) + 2 / 2 + 1)
