"""Checks every model file under ``examples/`` against the model-file contract."""

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.fx

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
EXAMPLES = ("vgg16", "resnet50", "inception", "gpt2", "mixer", "dlrm")
BATCH = 2
LAYER_OPS = ("call_module", "call_function", "call_method")


def load_example(name: str) -> ModuleType:
    path = EXAMPLES_DIR / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"deeppool_example_{name}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fx_layer_count(gm: torch.fx.GraphModule) -> int:
    return sum(1 for node in gm.graph.nodes if node.op in LAYER_OPS)


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_contract(name: str) -> None:
    ex = load_example(name)
    for attr in ("model", "inputs", "targets", "loss"):
        assert callable(getattr(ex, attr, None)), f"{name}.{attr} missing"

    torch.manual_seed(0)
    net = ex.model()
    batch = ex.inputs(BATCH)
    assert isinstance(batch, tuple) and batch
    for t in batch:
        assert t.shape[0] == BATCH
    # Inputs and targets are deterministic.
    for a, b in zip(batch, ex.inputs(BATCH)):
        assert torch.equal(a, b)
    tgt = ex.targets(BATCH)
    assert torch.equal(tgt, ex.targets(BATCH))
    assert tgt.shape[0] == BATCH

    gm = torch.fx.symbolic_trace(net)
    with torch.no_grad():
        eager_out = net(*batch)
        traced_out = gm(*batch)
    torch.testing.assert_close(traced_out, eager_out)
    assert eager_out.shape[0] == BATCH

    value = ex.loss(eager_out, tgt)
    assert value.dim() == 0
    assert torch.isfinite(value)

    assert fx_layer_count(gm) > 0

    # Per-sample along dim 0: in eval mode (BatchNorm uses running stats)
    # running the batch in two slices gives the same result as the whole.
    gm.eval()
    with torch.no_grad():
        whole = gm(*batch)
        halves = [gm(*(t[i : i + 1] for t in batch)) for i in range(BATCH)]
    torch.testing.assert_close(torch.cat(halves), whole)


def test_gpt2_has_many_layers() -> None:
    ex = load_example("gpt2")
    gm = torch.fx.symbolic_trace(ex.model())
    assert fx_layer_count(gm) >= 300
