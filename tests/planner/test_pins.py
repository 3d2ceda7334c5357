"""`--pin GLOB=N`: the pinned layers keep their counts, the ILP is optimal over the rest, mistakes name the layer."""

from __future__ import annotations

import itertools
import json

import pytest

from deeppool.errors import DeeppoolError
from deeppool.plans import Pin, Plan, Strategy
from deeppool.planner.api import PlanRequest, parse_pins, plan_graph
from tests.entry import deeppool
from tests.planner import synthetic
from tests.planner.test_ilp import BASES, CHAIN, RESIDUAL, SLOW_NETWORK, SPEC, _problem
from tests.planner.test_plan_options import A100


def _pinned_enumeration(cost, gpus: int, fixed: dict[str, int]) -> float:
    """The best iteration time over every count 1..gpus of the layers that are not fixed."""
    free = [name for name in cost.graph.names if name not in fixed]
    return min(
        cost.iteration_ms({**fixed, **dict(zip(free, counts, strict=True))})
        for counts in itertools.product(range(1, gpus + 1), repeat=len(free))
    )


@pytest.mark.parametrize(("graph", "pins", "fixed"), [
    (CHAIN, ("c=1",), {"c": 1}),
    (RESIDUAL, ("[bd]=5", "e=2"), {"b": 5, "d": 5, "e": 2}),
], ids=["chain", "residual-glob"])
def test_pinned_plan_equals_enumeration_over_the_free_layers(graph, pins, fixed):
    gpus, batch = 6, 12
    cost, profile = _problem(graph, gpus, batch)
    request = PlanRequest(gpus=gpus, global_batch=batch, pins=parse_pins(pins), max_candidates=None)
    plan = plan_graph(graph, profile, SLOW_NETWORK, request, model=SPEC).plan
    assert {name: plan.assignment[name] for name in fixed} == fixed
    assert plan.predicted.iteration_ms == pytest.approx(_pinned_enumeration(cost, gpus, fixed), rel=1e-6)
    free = plan_graph(graph, profile, SLOW_NETWORK, PlanRequest(gpus=gpus, global_batch=batch), model=SPEC).plan
    assert {name: free.assignment[name] for name in fixed} != fixed, "the pins must bind in this test"
    assert plan.pins == parse_pins(pins)
    assert Plan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


def test_pins_from_the_python_api_forms_are_the_same():
    assert parse_pins({"layer4.*": 8}) == parse_pins(["layer4.*=8"]) == (Pin(pattern="layer4.*", gpus=8),)
    assert Pin.parse("a=b=3") == Pin(pattern="a=b", gpus=3)


@pytest.mark.parametrize(("pins", "match"), [
    (("z*=2",), "matches no layer"),
    (("c=7",), "more than --gpus"),
    (("c=2", "[a-c]=3"), "layer 'c' is pinned to 2 GPUs"),
    (("c=0",), "at least 1 GPU"),
])
def test_impossible_pins_are_refused(pins, match):
    cost, profile = _problem(CHAIN, 6, 12)
    with pytest.raises(DeeppoolError, match=match):
        plan_graph(CHAIN, profile, SLOW_NETWORK, PlanRequest(gpus=6, global_batch=12, pins=parse_pins(pins)),
                   model=SPEC)


def test_a_pin_over_the_amplification_or_memory_limit_names_the_layer():
    gpus, batch = 4, 64
    cost, profile = _problem(CHAIN, gpus, batch)
    worst = max(range(2, gpus + 1), key=lambda g: cost.amplification(cost.graph.layer("d"), g))
    limit = (1 + cost.amplification(cost.graph.layer("d"), worst)) / 2
    with pytest.raises(DeeppoolError, match=f"pinned layer 'd' on {worst} GPUs has amplification"):
        plan_graph(CHAIN, profile, SLOW_NETWORK, PlanRequest(
            gpus=gpus, global_batch=batch, amplification=limit, pins=(Pin(pattern="d", gpus=worst),)), model=SPEC)
    roomy = cost.peak_memory_bytes(dict.fromkeys(CHAIN.names, gpus))
    tight = synthetic.profile(CHAIN, {n: BASES[n] for n in CHAIN.names}, 0.05, profile.layers["a"].batches,
                              roomy + 2**20)
    plan_graph(CHAIN, tight, SLOW_NETWORK, PlanRequest(gpus=gpus, global_batch=batch), model=SPEC)
    with pytest.raises(DeeppoolError, match="pinned layer 'b' on 1 GPUs needs"):
        plan_graph(CHAIN, tight, SLOW_NETWORK, PlanRequest(
            gpus=gpus, global_batch=batch, pins=(Pin(pattern="b", gpus=1),)), model=SPEC)


def test_pins_need_the_ilp_strategy():
    with pytest.raises(DeeppoolError, match="--strategy dp ignores it"):
        PlanRequest(gpus=2, global_batch=4, strategy=Strategy.DATA_PARALLEL, pins=(Pin(pattern="*", gpus=1),))


@pytest.mark.parametrize(("args", "named"), [
    (["--pin", "nothing*=1"], "matches no layer"),
    (["--pin", "fc1"], "GLOB=N"),
    (["--pin", "*=2", "--amplification", "1.0"], "pinned layer"),
])
def test_pin_mistakes_on_the_command_line_are_one_line_exit_2(capsys, tmp_path, monkeypatch, args, named):
    monkeypatch.chdir(tmp_path)
    result = deeppool(capsys, *A100, "--batch", "8", *args)
    lines = result.stderr.strip().splitlines()
    assert result.code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], result
    assert list(tmp_path.iterdir()) == []


def test_the_command_line_records_its_pins(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = deeppool(capsys, *A100, "--batch", "8", "--pin", "*=1", "--out", "p.json")
    assert result.code == 0, result
    plan = Plan.load(tmp_path / "p.json")
    assert plan.pins == (Pin(pattern="*", gpus=1),) and set(plan.assignment.values()) == {1}
