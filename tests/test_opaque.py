"""Eager-only code: submodules no tracer can see inside become opaque layers; branches on values in the root's
own code are specialised by the real-tensor tracer and listed; both plan and run as one process does.

The 4-rank burst runs of the zoo's ``moe`` and ``ragged_loop`` are in tests/test_zoo.py's heavy tier; here a
2-rank burst plan of the mixture-of-experts model runs with ``--check`` in the default run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deeppool.errors import DeeppoolError
from deeppool.model.graph import TraceMethod
from deeppool.model.loading import load_model
from deeppool.model.trace import check_branches, trace
from deeppool.plans import Branch, ModelSpec
from tests.entry import deeppool

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "tests" / "models"
ZOO = MODELS / "zoo"


def _trace(path: Path):
    return trace(load_model(ModelSpec.parse(str(path))))


def test_moe_blocks_are_opaque_layers_owning_their_parameters_with_flops_from_a_real_run():
    graph = _trace(ZOO / "moe.py").graph
    assert graph.method is TraceMethod.FX
    opaque = [layer for layer in graph.layers if layer.opaque]
    assert [layer.name for layer in opaque] == ["blocks_0_moe", "blocks_1_moe"]
    for layer in opaque:
        assert layer.op == "SparseMoE" and "moe.py:" in layer.opaque and "token.numel() == 0" in layer.opaque
        assert "a value-dependent branch" not in layer.opaque or "TraceError" in layer.opaque
        assert {name.split(".", 3)[-1].split(".")[0] for name in layer.params} == {"gate", "experts"}
        assert layer.fwd_flops > 0 and layer.bwd_flops > layer.fwd_flops  # counted from the real run
        assert len(layer.nodes) == 1  # one call_module node, run eagerly
    assert all(not layer.opaque for layer in graph.layers if "moe" not in layer.name)


def test_a_python_loop_over_a_tensors_values_is_an_opaque_layer():
    graph = _trace(ZOO / "ragged_loop.py").graph
    (pool,) = [layer for layer in graph.layers if layer.opaque]
    assert pool.name == "pool" and pool.op == "LengthPool" and "cannot be iterated" in pool.opaque
    assert set(pool.inputs) == {"tanh", "lengths"}


def test_an_opaque_module_that_mixes_samples_is_refused_naming_it():
    """untraceable.py's gate branches on the batch's sum: run eagerly per rank it would go another way."""
    with pytest.raises(DeeppoolError, match=r"module 'gate' gives sample \d another output when the batch's other") as err:
        _trace(MODELS / "untraceable.py")
    assert "torch.export cannot trace a value-dependent branch at " in str(err.value)
    assert "LayerDrop" not in str(err.value)  # a branch on the data, not on a random draw


def test_each_message_names_what_the_tracer_met():
    loaded = load_model(ModelSpec.parse(str(ZOO / "labelled_loss.py")))
    with pytest.raises(DeeppoolError, match=r"a slice with a tensor bound at \S+labelled_loss.py:33 \(`position_ids ="):
        trace(loaded, TraceMethod.FX)


@pytest.mark.slow
@pytest.mark.heavy
def test_a_branch_on_a_data_dependent_size_in_the_root_is_specialised_listed_and_trains_exactly(tmp_path: Path, capfd):
    """DeBERTa-v2's loss over the labelled rows: the branch is listed, ``nonzero``'s row positions are glue of the
    layers that gather with them, and the burst plan trains as one process does."""
    traced = _trace(ZOO / "labelled_loss.py")
    assert traced.graph.method is TraceMethod.REAL
    assert traced.graph.branches == (Branch(file=str(ZOO / "labelled_loss.py"), line=38, taken=True),)
    gathers = [layer for layer in traced.graph.layers if layer.op == "gather"]
    assert len(gathers) == 2 and all("nonzero" in layer.nodes for layer in gathers)
    plan = tmp_path / "plan.json"
    planned = deeppool(capfd, "plan", str(ZOO / "labelled_loss.py"), "--gpus", "2", "--batch", "4",
                       "--device-model", "a100", "--pin", "linear*=2", "--pin", "embedding=1", "--out", str(plan))
    assert planned.code == 0, planned.stderr[-2000:]
    assert "specialised branch at " in planned.stdout and "labelled_loss.py:38: taken yes" in planned.stdout
    assert json.loads(plan.read_text())["branches"][0]["line"] == 38
    ran = deeppool(capfd, "run", str(plan), "--nproc", "2", "--steps", "2", "--warmup", "0", "--check",
                   "--out", str(tmp_path / "run"))
    assert ran.code == 0, ran.stderr[-3000:]
    assert "max relative difference" in ran.stdout, ran.stdout[-3000:]


def test_a_branch_eager_torch_answers_with_an_int_is_left_to_the_comparison_of_results():
    planned = (Branch(file="m.py", line=3, taken=True), Branch(file="m.py", line=9, taken=False))
    check_branches(planned, [Branch(file="m.py", line=9, taken=False)])  # line 3 compares a size: not reported
    with pytest.raises(DeeppoolError, match="m.py:9"):
        check_branches(planned, [Branch(file="m.py", line=9, taken=True)])


@pytest.mark.slow
@pytest.mark.heavy
def test_moe_plans_and_trains_burst_parallel_exactly_on_two_ranks(tmp_path: Path, capfd):
    plan = tmp_path / "plan.json"
    planned = deeppool(capfd, "plan", str(ZOO / "moe.py"), "--gpus", "2", "--batch", "4", "--device-model", "a100",
                       "--pin", "blocks_*_moe=2", "--pin", "head=1", "--out", str(plan))
    assert planned.code == 0, planned.stderr[-3000:]
    assert "opaque layer blocks_0_moe (SparseMoE, run eagerly as one): TraceError" in planned.stdout
    layers = {layer["name"]: layer for layer in json.loads(plan.read_text())["layers"]}
    assert layers["blocks_0_moe"]["gpus"] == 2 and layers["head"]["gpus"] == 1 and layers["blocks_0_moe"]["opaque"]
    ran = deeppool(capfd, "run", str(plan), "--nproc", "2", "--steps", "2", "--warmup", "0", "--check",
                   "--out", str(tmp_path / "run"))
    assert ran.code == 0, ran.stderr[-3000:]
    assert "max relative difference" in ran.stdout, ran.stdout[-3000:]


@pytest.mark.slow
@pytest.mark.heavy
def test_layerdrop_zero_as_transformers_4_writes_it_plans_and_trains_exactly(tmp_path: Path, capfd):
    """The draw's branch in a model fx cannot trace at its root: specialised, listed, verified every step."""
    plan = tmp_path / "plan.json"
    planned = deeppool(capfd, "plan", str(ZOO / "layerdrop_shifted.py"), "--gpus", "2", "--batch", "4",
                       "--device-model", "a100", "--pin", "linear*=2", "--pin", "embedding=1", "--out", str(plan))
    assert planned.code == 0, planned.stderr[-2000:]
    assert "specialised branch at " in planned.stdout and "layerdrop_shifted.py:32: taken no" in planned.stdout
    ran = deeppool(capfd, "run", str(plan), "--nproc", "2", "--steps", "2", "--warmup", "0", "--check",
                   "--out", str(tmp_path / "run"))
    assert ran.code == 0, ran.stderr[-3000:]
    assert "max relative difference" in ran.stdout, ran.stdout[-3000:]


@pytest.mark.heavy
def test_layerdrop_above_zero_as_transformers_4_writes_it_is_refused_as_layerdrop(tmp_path: Path, capsys):
    result = deeppool(capsys, "plan", str(ZOO / "refused" / "layerdrop_shifted.py"), "--gpus", "2", "--batch", "4",
                      "--device-model", "a100", "--out", str(tmp_path / "plan.json"))
    assert result.code == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    (line,) = result.stderr.strip().splitlines()
    assert "layerdrop_shifted.py:32" in line and "LayerDrop above 0" in line and "set its probability to 0" in line
