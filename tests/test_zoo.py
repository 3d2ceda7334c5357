"""The zoo end to end: models written the way public zoos write them plan and train unchanged.

Every file under ``tests/models/zoo/`` is planned through the CLI's entry point (in this process) as a
user plans it: with A100 estimates on 4 GPUs, then, when the ILP gives every layer one GPU count, again
with ``--pin`` on two layer globs at two counts, so that the plan runs burst parallel; that plan is run
for real with ``deeppool run --nproc 4 --check`` against one process. Each model is also planned from a
local measurement (a short one: batch 4, per-GPU batches up to 2). The files under
``tests/models/zoo/refused/`` must be refused up front: exit 2, one line ``error: ...`` naming the module
at fault, no traceback.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.entry import Result, deeppool
from tests.executor.plans import cycle, make_plan_for

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "tests" / "models" / "zoo"
REFUSED = ZOO / "refused"

# file stem -> the `--pin GLOB=N` options a user would add when the ILP gives every layer one count
# (two globs, two counts: the traced layer names are export's op names or fx's module paths)
RUNS: dict[str, tuple[str, str]] = {
    "hf_gpt2": ("layer_norm*=4", "linear=2"),
    "hf_bert": ("linear*=2", "layer_norm*=4"),
    "hf_t5": ("linear*=2", "pow_*=4"),
    "hf_vit": ("linear*=2", "layer_norm*=4"),
    "hf_llama": ("linear*=2", "embedding=4"),
    "hf_gpt_neox": ("linear*=2", "layer_norm*=4"),
    "hf_bart": ("linear*=2", "layer_norm*=4"),
    "hf_whisper": ("linear*=2", "layer_norm*=4"),
    "hf_convnext": ("conv2d*=2", "linear*=4"),
    "hf_swin": ("linear*=2", "layer_norm*=4"),
    "hf_regnet": ("conv2d*=2", "relu*=4"),
    "tv_regnet": ("trunk_output_0_*=2", "stem_*=4"),
    "layerdrop_zero": ("encoder_layers_*=2", "head=4"),
    "tv_resnet": ("layer1_*=2", "layer2_*=4"),
    "tv_mobilenet": ("features_1_*=2", "features_0_*=4"),
    "tv_inception": ("mixed_5b_*=2", "conv2d_1a_3x3_conv=4"),
    "tv_densenet": ("features_denseblock1_*=2", "features_conv0=4"),
    "attn_shapes": ("linear*=2", "layer_norm*=4"),
    "fake_quant": ("blocks_*=2", "stem=4"),
    "moe": ("blocks_*_moe=2", "head=4"),
    "ragged_loop": ("pool=2", "head=4"),
    "labelled_loss": ("linear*=2", "embedding=4"),
    "layerdrop_shifted": ("linear*=2", "embedding=4"),
}
RANKS = 4
BATCH = 8


def load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"zoo_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_zoo_file_is_run() -> None:
    assert {p.stem for p in ZOO.glob("*.py")} - {"__init__"} == set(RUNS)


@pytest.mark.parametrize("name", sorted(RUNS))
def test_zoo_file_runs_eagerly(name: str) -> None:
    """The model itself is fine: deterministic inputs batched on dim 0, a scalar loss, gradients."""
    module = load(ZOO / f"{name}.py")
    net, batch = module.model(), module.inputs(3)
    tensors = list(batch.values()) if isinstance(batch, dict) else list(batch)
    assert all(t.shape[0] == 3 for t in tensors)
    again = module.inputs(3)
    assert all(torch.equal(a, b) for a, b in zip(tensors, again.values() if isinstance(again, dict) else again))
    output = net(**batch) if isinstance(batch, dict) else net(*batch)
    if hasattr(module, "loss"):
        loss = module.loss(output, module.targets(3) if hasattr(module, "targets") else None)
    else:
        loss = output.loss  # the model's own loss, computed from `labels`
    assert loss.dim() == 0
    loss.backward()
    assert any(p.grad is not None for p in net.parameters())


HEAVY = {"moe", "ragged_loop", "labelled_loss", "layerdrop_shifted", "hf_bart", "hf_whisper", "hf_t5", "hf_gpt_neox", "hf_convnext", "hf_swin", "hf_regnet",
         "hf_bert", "hf_llama", "tv_mobilenet", "tv_densenet", "tv_inception", "tv_regnet"}
"""The zoo's slowest burst runs (1-5 min each on 2 cores), and six (10-30 s each) whose kind a faster default run
covers (hf_bert: hf_gpt2's dict inputs and hf_vit's encoder; hf_llama: hf_gpt2's decoder and causal mask, its
autocast-on-meta tracing planned by test_a_model_that_autocasts_plans_from_cpu_tensors; tv_mobilenet,
tv_densenet and tv_regnet: tv_resnet's convolutions, BatchNorm and residuals, tv_inception's concatenations, and
tv_regnet's build that fails on meta is planned by its local-measurement test in the default run; tv_inception
itself: its pinned burst plan is planned and run on 4 ranks with --check by
test_inception_aux_batchnorm_at_one_sample_per_gpu_trains_exactly; moe and ragged_loop, whose opaque layers
tests/test_opaque.py plans and runs on 2 ranks; labelled_loss and
layerdrop_shifted, whose real-tensor traces take 10-40 s, planned and run on 2 ranks in tests/test_opaque.py's
heavy tier): in the heavy tier, not the default test run."""

LOCAL = {"hf_gpt2", "tv_regnet"}
"""Planned from a local measurement in the default test run (a dict of inputs; a model that cannot be
built on meta); the others' local plans (1-3 min each on 2 cores) are in the heavy tier."""

def _counts(plan: Path) -> set[int]:
    return {layer["gpus"] for layer in json.loads(plan.read_text())["layers"]}


def plan_burst(capfd, name: str, out: Path) -> None:
    """``deeppool plan`` with A100 estimates; again with :data:`RUNS`' pins when the ILP picks one count."""
    args = ["plan", str(ZOO / f"{name}.py"), "--gpus", str(RANKS), "--batch", str(BATCH), "--device-model", "a100"]
    planned = deeppool(capfd, *args, "--out", str(out))
    assert planned.code == 0, planned.stderr[-3000:]
    assert len(json.loads(out.read_text())["layers"]) >= 2
    if len(_counts(out)) >= 2:
        return
    pinned = deeppool(capfd, *args, *(option for pin in RUNS[name] for option in ("--pin", pin)), "--out", str(out))
    assert pinned.code == 0, pinned.stderr[-3000:]
    layers = json.loads(out.read_text())["layers"]
    for pin in RUNS[name]:
        pattern, count = pin.rsplit("=", 1)
        matched = [layer for layer in layers if fnmatch.fnmatchcase(layer["name"], pattern)]
        assert matched and all(layer["gpus"] == int(count) for layer in matched), (pin, matched)


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.heavy) if n in HEAVY else n for n in sorted(RUNS)])
def test_zoo_model_plans_and_trains_burst_parallel_exactly(tmp_path: Path, capfd, name: str) -> None:
    plan = tmp_path / "plan.json"
    plan_burst(capfd, name, plan)
    assert len(_counts(plan)) >= 2  # a burst plan, not data parallel
    out = tmp_path / "run"
    ran = deeppool(capfd, "run", str(plan), "--nproc", str(RANKS), "--steps", "2", "--warmup", "0",
                   "--check", "--out", str(out))
    assert ran.code == 0, ran.stderr[-3000:]
    assert "max relative difference" in ran.stdout, ran.stdout[-3000:]
    assert (out / "summary.json").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("name", [n if n in LOCAL else pytest.param(n, marks=pytest.mark.heavy) for n in sorted(RUNS)])
def test_zoo_model_plans_with_local_measurement(tmp_path: Path, capfd, name: str) -> None:
    """Measured here, not estimated: every zoo model, with a short measurement (batch 4 on 2 GPUs)."""
    planned = deeppool(capfd, "plan", str(ZOO / f"{name}.py"), "--gpus", "2", "--batch", "4",
                       "--max-measured-batch", "2", "--cache-dir", str(tmp_path / "cache"),
                       "--network", "local", "--out", str(tmp_path / "plan.json"))
    assert planned.code == 0, planned.stderr[-3000:]
    assert "Traceback" not in planned.stderr
    assert len(json.loads((tmp_path / "plan.json").read_text())["layers"]) >= 2


@pytest.mark.slow
def test_a_model_that_autocasts_plans_from_cpu_tensors(tmp_path: Path, capfd) -> None:
    """Llama's rotary embeddings run under ``torch.autocast``, which raises on the meta device: the planner
    traces it on CPU tensors and plans it (its 4-rank burst run is in the heavy tier)."""
    plan = tmp_path / "plan.json"
    planned = deeppool(capfd, "plan", str(ZOO / "hf_llama.py"), "--gpus", str(RANKS), "--batch", str(BATCH),
                       "--device-model", "a100", "--out", str(plan))
    assert planned.code == 0 and "Traceback" not in planned.stderr, planned.stderr[-3000:]
    assert len(json.loads(plan.read_text())["layers"]) >= 2


@pytest.mark.slow
def test_inception_aux_batchnorm_at_one_sample_per_gpu_trains_exactly(tmp_path: Path, capfd) -> None:
    """The aux head's BatchNorm on a 1x1 map cannot train on one sample alone; on 4 GPUs at batch 4 it runs as
    one group over the layer's 4 samples, as in one process, so that count is a plan the executor takes."""
    plan = tmp_path / "plan.json"
    planned = deeppool(capfd, "plan", str(ZOO / "tv_inception.py"), "--gpus", "4", "--batch", "4", "--device-model",
                       "a100", "--pin", "aux_logits_*=4", "--pin", "mixed_5b_*=2", "--out", str(plan))
    assert planned.code == 0, planned.stderr[-3000:]
    aux = [layer for layer in json.loads(plan.read_text())["layers"] if layer["name"].startswith("aux_logits_conv1_")]
    assert aux and all(layer["gpus"] == 4 and all(b - a == 1 for a, b in layer["samples"]) for layer in aux), aux
    ran = deeppool(capfd, "run", str(plan), "--nproc", "4", "--steps", "2", "--warmup", "0", "--check",
                   "--out", str(tmp_path / "run"))
    assert ran.code == 0 and "Traceback" not in ran.stderr, ran.stderr[-3000:]
    assert "max relative difference" in ran.stdout, ran.stdout[-3000:]


def assert_refused(result: Result, module: str) -> None:
    assert result.code == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"'{module}'" in lines[0], lines


@pytest.mark.slow
def test_data_dependent_control_flow_is_refused_at_plan_time(tmp_path: Path, capfd) -> None:
    result = deeppool(capfd, "plan", str(REFUSED / "data_dependent.py"), "--gpus", "4", "--batch", "8",
                      "--device-model", "a100", "--out", str(tmp_path / "plan.json"))
    assert_refused(result, "gate")


@pytest.mark.slow
@pytest.mark.parametrize(("name", "words"), [
    ("layerdrop", ("layerdrop.py:", "if torch.rand([]) < self.layerdrop", "set its probability to 0")),
    ("running_mean", ("'norm.mean'", "from the batch's values")),
    ("contrastive", ("makes the batch size a constant", "contrastive loss")),
])
def test_model_is_refused_at_plan_time_naming_the_line_or_buffer(
    tmp_path: Path, capfd, name: str, words: tuple[str, ...]
) -> None:
    result = deeppool(capfd, "plan", str(REFUSED / f"{name}.py"), "--gpus", "4", "--batch", "8",
                      "--device-model", "a100", "--out", str(tmp_path / "plan.json"))
    assert result.code == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.stderr, lines
    assert all(word in lines[0] for word in words), lines[0]
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.slow
def test_batch_mixing_is_refused_before_training(tmp_path: Path, capfd) -> None:
    make_plan_for(REFUSED / "batch_mixing.py", global_batch=8, gpus=2, assign=cycle(2, 1)).save(tmp_path / "p.json")
    result = deeppool(capfd, "run", str(tmp_path / "p.json"), "--nproc", "2", "--steps", "2", "--warmup", "0",
                      "--out", str(tmp_path / "run"))
    assert_refused(result, "center")
