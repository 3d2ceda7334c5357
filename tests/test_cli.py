"""The `deeppool` command through its real entry point (:func:`deeppool.cli.main`), in-process where a
subprocess adds nothing: the main job works, and every user mistake is one line starting ``error:``, exit 2,
no traceback, the flag the user typed named, and no file left behind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deeppool.cli import default_output
from tests.entry import deeppool

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "tests" / "models" / "tiny_mlp.py")
PNG = b"\x89PNG\r\n\x1a\n"


def files_under(folder: Path) -> set[Path]:
    return {path.relative_to(folder) for path in folder.rglob("*")}


@pytest.fixture(scope="session")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Files the mistakes point at: a plan, a profile, a corrupted and an old JSON, a plain file, a folder."""
    folder = tmp_path_factory.mktemp("workspace")
    (folder / "corrupt.json").write_text('{"schema_version": 1')
    (folder / "old.json").write_text(json.dumps({"artifact": "profile", "schema_version": 0}))
    (folder / "existing.txt").write_text("not a folder\n")
    (folder / "folder").mkdir()
    (folder / "earlier").mkdir()  # a simulation's --out, from an earlier run of each
    for name in ("metrics.json", "scenario.json"):
        (folder / "earlier" / name).write_text("{}\n")
    (folder / "model.py").write_text(Path(TINY).read_text())
    (folder / "trace.csv").write_text("name,time,application,num_replicas,batch_size,duration\na,0,tiny,2,64,10\n")
    from deeppool.plans import ModelSpec
    from deeppool.planner.api import CostSource, PlanRequest, plan_model

    spec = ModelSpec.parse(TINY)
    for gpus, batch, name in ((2, 16, "plan.json"), (1024, 1024, "plan1024.json")):
        planned = plan_model(spec, PlanRequest(gpus=gpus, global_batch=batch), CostSource(device_model="h100"))
        planned.plan.save(folder / name)
    return folder


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


# -- the main job --------------------------------------------------------------------------------------------
def test_plan_writes_plan_and_gantt(capsys, tmp_path):
    out, chart = tmp_path / "plan.json", tmp_path / "plan.png"
    result = deeppool(capsys, "plan", TINY, "--gpus", "8", "--batch", "32", "--device-model", "h100",
                      "--out", str(out), "--gantt", str(chart))
    assert result.code == 0, result.stderr
    assert "data parallel" in result.stdout and "amplification: a layer's GPU-time" in result.stdout
    assert "DP" not in result.stdout.replace("DeepPool", "")  # "DP" never stands for two things
    plan = json.loads(out.read_text())
    assert plan["gpus"] == 8 and plan["global_batch"] == 32 and plan["device"] == "h100"
    assert plan["predicted"]["iteration_ms"] <= plan["predicted"]["data_parallel_iteration_ms"] + 1e-9
    assert chart.read_bytes()[:8] == PNG


def test_the_amplification_figures_say_what_they_are(capsys, tmp_path):
    from deeppool.plans import Plan
    from deeppool.planner.report import stages

    out = tmp_path / "vgg16.json"
    result = deeppool(capsys, "plan", str(ROOT / "examples" / "vgg16.py"), "--gpus", "64", "--batch", "128",
                      "--device-model", "a100", "--objective", "cluster", "--out", str(out))
    assert result.code == 0, result.stderr
    plan = Plan.load(out)
    header = next(line for line in result.stdout.splitlines() if "op(s)" in line)
    assert header.split("┃")[-2].strip() == "worst layer amp."
    rows = [line.split("│") for line in result.stdout.splitlines() if line.startswith("│")]
    shown = [row[-2].strip() for row in rows]
    assert len(shown) == len(stages(plan)) > 1
    assert shown == [f"{max(layer.amplification for layer in stage.layers):.2f}" for stage in stages(plan)]
    assert f"whole-iteration amplification {plan.predicted.amplification:.2f}," in result.stdout
    assert "each stage's worst layer" in result.stdout
    per_layer = deeppool(capsys, "plan", str(ROOT / "examples" / "vgg16.py"), "--gpus", "64", "--batch", "128",
                         "--device-model", "a100", "--objective", "cluster", "--per-layer",
                         "--out", str(tmp_path / "per-layer.json"))
    header = next(line for line in per_layer.stdout.splitlines() if "op(s)" in line)
    assert header.split("┃")[-2].strip() == "amplification"  # a layer's own


def test_piped_output_is_never_wrapped_or_cut(capsys, tmp_path):
    result = deeppool(capsys, "plan", "tests.models.factories:small_cnn", "--input-shape", "3,8,8", "--gpus", "4",
                      "--batch", "16", "--device-model", "a100", "--out", str(tmp_path / "p.json"))
    assert result.code == 0, result.stderr
    summary = next(line for line in result.stdout.splitlines() if line.startswith("iteration "))
    assert summary.rstrip().endswith(")") and "solver" in summary  # the whole summary on one line
    assert "…" not in result.stdout.replace(" … ", "")  # op lists are never cut


def test_default_plan_name_comes_from_the_model(capsys, in_tmp):
    result = deeppool(capsys, "plan", TINY, "--gpus", "2", "--batch", "8", "--device-model", "a100")
    assert result.code == 0, result.stderr
    assert (in_tmp / "tiny_mlp-plan.json").is_file()
    assert default_output("examples/resnet50.py", "plan.json") == Path("resnet50-plan.json")
    assert default_output("tests.models.factories:small_cnn", "plan.json") == Path("small_cnn-plan.json")


def test_profile_measures_here_then_plans_from_the_file(capsys, tmp_path):
    profile = tmp_path / "tiny-cpu.json"
    measured = deeppool(capsys, "profile", TINY, "--out", str(profile), "--batches", "1,2,4", "--repeats", "2",
                        "--warmup", "1", "--cache-dir", str(tmp_path / "cache"))
    assert measured.code == 0, measured.stderr
    data = json.loads(profile.read_text())
    assert data["source"] == "measured" and set(data["layers"]) == {"fc1", "act", "fc2", "add", "head"}
    assert all(t > 0 for entry in data["layers"].values() for t in entry["fwd_ms"])
    planned = deeppool(capsys, "plan", TINY, "--gpus", "4", "--batch", "4", "--profile", str(profile),
                       "--out", str(tmp_path / "p.json"))
    assert planned.code == 0, planned.stderr
    assert json.loads((tmp_path / "p.json").read_text())["device"] == data["device"]


def test_factory_form_with_input_shape(capsys, tmp_path):
    result = deeppool(capsys, "plan", "tests.models.factories:small_cnn", "--input-shape", "3,8,8", "--gpus", "4",
                      "--batch", "16", "--device-model", "a100", "--out", str(tmp_path / "p.json"))
    assert result.code == 0, result.stderr
    model = json.loads((tmp_path / "p.json").read_text())["model"]
    root = model.pop("root")
    assert model == {"source": "factory", "location": "tests.models.factories:small_cnn",
                     "input_shape": [3, 8, 8], "input_dtype": "float32", "vocab_size": 0, "seed": 0}
    assert (tmp_path / root).resolve() == Path.cwd().resolve()  # where it imports from, relative to the plan


def test_factory_with_token_inputs(capsys, tmp_path):
    result = deeppool(capsys, "plan", "tests.models.token_factory:tiny_lm", "--input-shape", "16", "--input-dtype",
                      "int64", "--vocab-size", "64", "--gpus", "2", "--batch", "4", "--device-model", "a100",
                      "--out", str(tmp_path / "p.json"))
    assert result.code == 0, result.stderr
    model = json.loads((tmp_path / "p.json").read_text())["model"]
    assert (model["input_dtype"], model["vocab_size"]) == ("int64", 64)


def test_memory_infeasible_names_the_layer(capsys, tmp_path):
    profile = tmp_path / "small-device.json"
    assert deeppool(capsys, "profile", TINY, "--out", str(profile), "--batches", "1,2", "--repeats", "1",
                    "--cache-dir", str(tmp_path)).code == 0
    data = json.loads(profile.read_text())
    data["memory_bytes"] = 1000
    profile.write_text(json.dumps(data))
    result = deeppool(capsys, "plan", TINY, "--gpus", "2", "--batch", "2", "--profile", str(profile),
                      "--out", str(tmp_path / "p.json"))
    assert result.code == 2
    assert "infeasible" in result.stderr and "layer 'fc1'" in result.stderr


# -- user mistakes: one line, exit 2, the flag named, nothing left behind ------------------------------------
MISTAKES: list[tuple[str, list[str], str]] = [
    # the issue's
    ("simulate --out is a file", ["simulate", "synthetic", "--gpus", "8", "--out", "{ws}/existing.txt"], "--out"),
    ("plan --out is a folder", ["plan", TINY, "--gpus", "2", "--out", "{tmp}"], "--out"),
    ("plan --gantt unknown format", ["plan", TINY, "--gpus", "2", "--gantt", "g.xyz"], "--gantt"),
    ("run --out is a file", ["run", "{ws}/plan.json", "--out", "{ws}/existing.txt"], "--out"),
    ("profile --device tpu", ["profile", TINY, "--device", "tpu", "--out", "p.json"], "--device"),
    ("plan --profile missing", ["plan", TINY, "--gpus", "2", "--profile", "nope.json"], "--profile"),
    ("plan --time-limit -1", ["plan", TINY, "--gpus", "2", "--time-limit", "-1"], "--time-limit"),
    ("plan --optimizer lamb", ["plan", TINY, "--gpus", "2", "--optimizer", "lamb"], "--optimizer"),
    ("plan --gpus 100000", ["plan", TINY, "--gpus", "100000"], "--gpus"),
    ("more GPUs than samples", ["plan", TINY, "--gpus", "64", "--batch", "8"], "--gpus"),
    ("--input-shape with a model file", ["plan", TINY, "--gpus", "2", "--input-shape", "3,32,32"], "--input-shape"),
    ("--local-device cuda without CUDA", ["plan", TINY, "--gpus", "2", "--local-device", "cuda"], "--local-device"),
    ("--network tpu", ["plan", TINY, "--gpus", "2", "--device-model", "a100", "--network", "tpu"], "--network"),
    ("run more ranks than this machine", ["run", "{ws}/plan1024.json"], "--nproc"),
    ("run --warmup not below --steps", ["run", "{ws}/plan.json", "--steps", "2", "--warmup", "5"], "--warmup"),
    # plan
    ("plan missing model file", ["plan", "nope.py", "--gpus", "2"], "model file"),
    ("plan model neither file nor factory", ["plan", "resnet", "--gpus", "2"], "package.module:callable"),
    ("plan --gpus 0", ["plan", TINY, "--gpus", "0"], "--gpus"),
    ("plan --gpus not a number", ["plan", TINY, "--gpus", "two"], "--gpus"),
    ("plan without --gpus", ["plan", TINY], "--gpus"),
    ("plan unknown option", ["plan", TINY, "--gpus", "2", "--gpu-count", "3"], "--gpu-count"),
    ("plan --batch 0", ["plan", TINY, "--gpus", "2", "--batch", "0"], "--batch"),
    ("plan --batch negative", ["plan", TINY, "--gpus", "2", "--batch", "-5"], "--batch"),
    ("plan --amplification below 1", ["plan", TINY, "--gpus", "2", "--amplification", "0.5"], "--amplification"),
    ("plan --max-candidates 1", ["plan", TINY, "--gpus", "2", "--max-candidates", "1"], "--max-candidates"),
    ("plan --max-measured-batch 0", ["plan", TINY, "--gpus", "2", "--max-measured-batch", "0"],
     "--max-measured-batch"),
    ("plan --strategy magic", ["plan", TINY, "--gpus", "2", "--strategy", "magic"], "--strategy"),
    ("plan --solver gurobi", ["plan", TINY, "--gpus", "2", "--solver", "gurobi"], "--solver"),
    ("plan --device-model tpu9", ["plan", TINY, "--gpus", "2", "--device-model", "tpu9"], "--device-model"),
    ("plan --profile and --device-model", ["plan", TINY, "--gpus", "2", "--profile", "{ws}/corrupt.json",
                                           "--device-model", "a100"], "--device-model"),
    ("plan corrupted --profile", ["plan", TINY, "--gpus", "2", "--profile", "{ws}/corrupt.json"], "not valid JSON"),
    ("plan --batch auto without --gns", ["plan", TINY, "--gpus", "2", "--batch", "auto"], "--gns"),
    ("plan --gns 0", ["plan", TINY, "--gpus", "2", "--batch", "auto", "--gns", "0"], "--gns"),
    ("plan --gns negative", ["plan", TINY, "--gpus", "2", "--batch", "auto", "--gns", "-50"], "--gns"),
    ("plan --gns without --batch auto", ["plan", TINY, "--gpus", "2", "--gns", "100"], "--gns"),
    ("plan --batches without --batch auto", ["plan", TINY, "--gpus", "2", "--batches", "8,16"], "--batches"),
    ("plan --batch neither number nor auto", ["plan", TINY, "--gpus", "2", "--batch", "big"], "--batch"),
    ("plan --batches below --gpus", ["plan", TINY, "--gpus", "4", "--batch", "auto", "--gns", "100",
                                     "--batches", "2,8"], "--batches"),
    ("plan --batches empty", ["plan", TINY, "--gpus", "2", "--batch", "auto", "--gns", "100", "--batches", ","],
     "--batches"),
    ("plan --base-batch 0", ["plan", TINY, "--gpus", "2", "--batch", "auto", "--gns", "100", "--base-batch", "0"],
     "--base-batch"),
    ("plan --goodput-plot not a PNG", ["plan", TINY, "--gpus", "2", "--batch", "auto", "--gns", "100",
                                       "--goodput-plot", "g.pdf"], "--goodput-plot"),
    ("plan old --profile", ["plan", TINY, "--gpus", "2", "--profile", "{ws}/old.json"], "schema_version 0"),
    ("plan --profile is a folder", ["plan", TINY, "--gpus", "2", "--profile", "{ws}/folder"], "--profile"),
    ("plan --network and --network-file", ["plan", TINY, "--gpus", "2", "--device-model", "a100", "--network",
                                           "a100", "--network-file", "{ws}/corrupt.json"], "--network-file"),
    ("plan --network-file missing", ["plan", TINY, "--gpus", "2", "--network-file", "net.json"], "--network-file"),
    ("plan --gpus-per-node 0", ["plan", TINY, "--gpus", "2", "--gpus-per-node", "0"], "--gpus-per-node"),
    ("plan --intra-gbps 0", ["plan", TINY, "--gpus", "2", "--intra-gbps", "0"], "--intra-gbps"),
    ("plan --inter-gbps negative", ["plan", TINY, "--gpus", "2", "--inter-gbps", "-1"], "--inter-gbps"),
    ("plan --gantt is a folder", ["plan", TINY, "--gpus", "2", "--gantt", "{tmp}"], "--gantt"),
    ("plan --gantt same as --out", ["plan", TINY, "--gpus", "2", "--out", "x.png", "--gantt", "x.png"], "--gantt"),
    ("plan --out is the model file", ["plan", "{ws}/model.py", "--gpus", "2", "--out", "{ws}/model.py"], "--out"),
    ("profile --out is the model file", ["profile", "{ws}/model.py", "--out", "{ws}/model.py"], "--out"),
    ("plan --out under a file", ["plan", TINY, "--gpus", "2", "--out", "{ws}/existing.txt/p.json"], "--out"),
    ("plan --cache-dir is a file", ["plan", TINY, "--gpus", "2", "--cache-dir", "{ws}/existing.txt"], "--cache-dir"),
    ("plan --input-shape not numbers", ["plan", "tests.models.factories:small_cnn", "--gpus", "2",
                                        "--input-shape", "3,x"], "--input-shape"),
    ("plan --input-shape zero", ["plan", "tests.models.factories:small_cnn", "--gpus", "2", "--input-shape", "0,8"],
     "--input-shape"),
    ("plan factory without --input-shape", ["plan", "tests.models.factories:small_cnn", "--gpus", "2"],
     "--input-shape"),
    ("plan --input-dtype float99", ["plan", "tests.models.factories:small_cnn", "--input-shape", "3,8,8",
                                    "--input-dtype", "float99", "--gpus", "2"], "--input-dtype"),
    ("plan token ids without --vocab-size", ["plan", "tests.models.token_factory:tiny_lm", "--input-shape", "16",
                                             "--input-dtype", "int64", "--gpus", "2"], "--vocab-size"),
    ("plan --vocab-size with a model file", ["plan", TINY, "--gpus", "2", "--vocab-size", "100"], "--vocab-size"),
    ("plan --input-dtype with a model file", ["plan", TINY, "--gpus", "2", "--input-dtype", "int64"],
     "--input-dtype"),
    ("plan factory that does not import", ["plan", "no.such.module:make", "--input-shape", "3", "--gpus", "2",
                                           "--device-model", "a100"], "no.such.module"),
    ("plan model file without inputs()", ["plan", str(ROOT / "tests/models/no_inputs.py"), "--gpus", "2",
                                          "--device-model", "a100"], "inputs()"),
    ("plan untraceable model", ["plan", str(ROOT / "tests/models/untraceable.py"), "--gpus", "2",
                                "--device-model", "a100"], "cannot trace module 'gate'"),
    # profile
    ("profile without --out", ["profile", TINY], "--out"),
    ("profile --out is a folder", ["profile", TINY, "--out", "{tmp}"], "--out"),
    ("profile --device cuda:x", ["profile", TINY, "--device", "cuda:x", "--out", "p.json"], "--device"),
    ("profile --batches with 0", ["profile", TINY, "--batches", "0,1", "--out", "p.json"], "--batches"),
    ("profile --batches not numbers", ["profile", TINY, "--batches", "a,b", "--out", "p.json"], "--batches"),
    ("profile --repeats 0", ["profile", TINY, "--repeats", "0", "--out", "p.json"], "--repeats"),
    ("profile --warmup negative", ["profile", TINY, "--warmup", "-1", "--out", "p.json"], "--warmup"),
    ("profile --cache-dir is a file", ["profile", TINY, "--cache-dir", "{ws}/existing.txt", "--out", "p.json"],
     "--cache-dir"),
    ("profile --input-shape with a model file", ["profile", TINY, "--input-shape", "16", "--out", "p.json"],
     "--input-shape"),
    # run
    ("run missing plan", ["run", "nope.json"], "plan file"),
    ("run corrupted plan", ["run", "{ws}/corrupt.json"], "not valid JSON"),
    ("run --nproc differs from the plan", ["run", "{ws}/plan.json", "--nproc", "3"], "--nproc"),
    ("run --nproc 0", ["run", "{ws}/plan.json", "--nproc", "0"], "--nproc"),
    ("run --steps 0", ["run", "{ws}/plan.json", "--steps", "0"], "--steps"),
    ("run --warmup negative", ["run", "{ws}/plan.json", "--warmup", "-1"], "--warmup"),
    ("run --lr 0", ["run", "{ws}/plan.json", "--lr", "0"], "--lr"),
    ("run --momentum 1.5", ["run", "{ws}/plan.json", "--momentum", "1.5"], "--momentum"),
    ("run --timeout 0", ["run", "{ws}/plan.json", "--timeout", "0"], "--timeout"),
    ("run --bucket-mb negative", ["run", "{ws}/plan.json", "--bucket-mb", "-1"], "--bucket-mb"),
    ("run --check-bound 0", ["run", "{ws}/plan.json", "--check-bound", "0"], "--check-bound"),
    ("run --optimizer lamb", ["run", "{ws}/plan.json", "--optimizer", "lamb"], "--optimizer"),
    ("run --backend mpi", ["run", "{ws}/plan.json", "--backend", "mpi"], "--backend"),
    ("run --background missing", ["run", "{ws}/plan.json", "--background", "bg.py"], "--background"),
    ("run --mux magic", ["run", "{ws}/plan.json", "--mux", "magic"], "--mux"),
    ("run --bg-batch 0", ["run", "{ws}/plan.json", "--background", TINY, "--bg-batch", "0"], "--bg-batch"),
    ("run --bg-lr 0", ["run", "{ws}/plan.json", "--background", TINY, "--bg-lr", "0"], "--bg-lr"),
    ("run --slowdown-target 2", ["run", "{ws}/plan.json", "--background", TINY, "--slowdown-target", "2"],
     "--slowdown-target"),
    ("run --mps-percentage 0", ["run", "{ws}/plan.json", "--background", TINY, "--mps-percentage", "0"],
     "--mps-percentage"),
    ("run --bg-checkpoint-dir is a file", ["run", "{ws}/plan.json", "--background", TINY, "--bg-checkpoint-dir",
                                           "{ws}/existing.txt"], "--bg-checkpoint-dir"),
    ("run --model missing", ["run", "{ws}/plan.json", "--model", "nope.py"], "model file 'nope.py'"),
    ("run --precision fp8", ["run", "{ws}/plan.json", "--precision", "fp8"], "--precision"),
    ("run --loss-scale 0", ["run", "{ws}/plan.json", "--loss-scale", "0"], "--loss-scale"),
    ("run --data without a factory", ["run", "{ws}/plan.json", "--data", "mydata"], "--data 'mydata'"),
    ("run --data file missing", ["run", "{ws}/plan.json", "--data", "nope.py:train"], "no file 'nope.py'"),
    ("run --data-workers negative", ["run", "{ws}/plan.json", "--data", "m:f", "--data-workers", "-1"],
     "--data-workers"),
    # simulate
    ("simulate --gpus 0", ["simulate", "synthetic", "--gpus", "0"], "--gpus"),
    ("simulate --gpus-per-node 0", ["simulate", "synthetic", "--gpus", "8", "--gpus-per-node", "0"],
     "--gpus-per-node"),
    ("simulate --policy pollux on a synthetic trace", ["simulate", "synthetic", "--gpus", "8", "--policy", "pollux"],
     "--policy pollux"),
    ("simulate --policy pollux without measurements", ["simulate", "{ws}/trace.csv", "--gpus", "8", "--policy",
                                                        "pollux"], "--pollux-traces"),
    ("simulate --policy magic", ["simulate", "synthetic", "--gpus", "8", "--policy", "magic"], "--policy"),
    ("simulate --device tpu", ["simulate", "synthetic", "--gpus", "8", "--device", "tpu"], "--device"),
    ("simulate --burst-strategy dp", ["simulate", "synthetic", "--gpus", "8", "--burst-strategy", "dp"],
     "--burst-strategy"),
    ("simulate --plan-time-limit 0", ["simulate", "synthetic", "--gpus", "8", "--plan-time-limit", "0"],
     "--plan-time-limit"),
    ("simulate --plan-workers 0", ["simulate", "synthetic", "--gpus", "8", "--plan-workers", "0"], "--plan-workers"),
    ("simulate --mapping missing", ["simulate", "synthetic", "--gpus", "8", "--mapping", "map.json"], "--mapping"),
    ("simulate --interference missing", ["simulate", "synthetic", "--gpus", "8", "--interference", "i.json"],
     "--interference"),
    ("simulate --jobs 0", ["simulate", "synthetic", "--gpus", "8", "--jobs", "0"], "--jobs"),
    ("simulate --size-mix bad", ["simulate", "synthetic", "--gpus", "8", "--size-mix", "many"], "--size-mix"),
    ("simulate --fg-slowdown below 1", ["simulate", "synthetic", "--gpus", "8", "--fg-slowdown", "0.5"],
     "--fg-slowdown"),
    ("simulate trace missing", ["simulate", "nosuch.csv", "--gpus", "8"], "trace file"),
    ("simulate --cache-dir is a file", ["simulate", "{ws}/trace.csv", "--gpus", "8", "--cache-dir",
                                        "{ws}/existing.txt"], "--cache-dir"),
    ("simulate --out holds an earlier run", ["simulate", "synthetic", "--gpus", "8", "--out", "{ws}/earlier"],
     "--force"),
    ("simulate-deeppool --out holds an earlier run", ["simulate-deeppool", "--out", "{ws}/earlier"], "--force"),
    # multiplex bench
    ("bench missing plan", ["multiplex", "bench", "nope.json", "--background", TINY, "--out", "b"], "plan file"),
    ("bench --background missing", ["multiplex", "bench", "{ws}/plan.json", "--background", "bg.py", "--out", "b"],
     "--background"),
    ("bench without --out", ["multiplex", "bench", "{ws}/plan.json", "--background", TINY], "--out"),
    ("bench --out is a file", ["multiplex", "bench", "{ws}/plan.json", "--background", TINY, "--out",
                               "{ws}/existing.txt"], "--out"),
    ("bench --modes magic", ["multiplex", "bench", "{ws}/plan.json", "--background", TINY, "--out", "b",
                             "--modes", "gate,magic"], "--modes"),
    ("bench --modes twice", ["multiplex", "bench", "{ws}/plan.json", "--background", TINY, "--out", "b",
                             "--modes", "gate,gate"], "--modes"),
    ("bench --steps too few", ["multiplex", "bench", "{ws}/plan.json", "--background", TINY, "--out", "b",
                               "--steps", "3"], "--steps"),
    ("bench --bg-batch 0", ["multiplex", "bench", "{ws}/plan.json", "--background", TINY, "--out", "b",
                            "--bg-batch", "0"], "--bg-batch"),
    ("bench --bg-lr 0", ["multiplex", "bench", "{ws}/plan.json", "--background", TINY, "--out", "b",
                         "--bg-lr", "0"], "--bg-lr"),
    ("bench --slowdown-target 0", ["multiplex", "bench", "{ws}/plan.json", "--background", TINY, "--out", "b",
                                   "--slowdown-target", "0"], "--slowdown-target"),
    # export
    ("export a missing folder", ["export", "{tmp}/nowhere", "--out", "m.pt"], "does not exist"),
    ("export a folder with no checkpoint", ["export", "{tmp}", "--out", "m.pt"], "no complete checkpoint"),
    ("export --out is a folder", ["export", "{tmp}", "--out", "{tmp}"], "--out"),
    ("export --plan missing", ["export", "{tmp}", "--out", "m.pt", "--plan", "{tmp}/none.json"], "--plan"),
    # profile-network
    ("profile-network --nproc 1", ["profile-network", "--out", "n.json", "--nproc", "1"], "--nproc"),
    ("profile-network --nproc far too many", ["profile-network", "--out", "n.json", "--nproc", "100000"], "--nproc"),
    ("profile-network --sizes 2 bytes", ["profile-network", "--out", "n.json", "--sizes", "2"], "--sizes"),
    ("profile-network --sizes not numbers", ["profile-network", "--out", "n.json", "--sizes", "1k"], "--sizes"),
    ("profile-network --repeats 0", ["profile-network", "--out", "n.json", "--repeats", "0"], "--repeats"),
    ("profile-network --warmup negative", ["profile-network", "--out", "n.json", "--warmup", "-1"], "--warmup"),
    ("profile-network --out is a folder", ["profile-network", "--out", "{tmp}"], "--out"),
    # the coordinator
    ("serve --port 0", ["serve", "--port", "0"], "--port"),
    ("serve --port too large", ["serve", "--port", "70000"], "--port"),
    ("serve --gpus not a number", ["serve", "--gpus", "many"], "--gpus"),
    ("serve --gpus 0", ["serve", "--gpus", "0"], "--gpus"),
    ("serve --allow missing folder", ["serve", "--allow", "{tmp}/nowhere"], "--allow"),
    ("serve --db is a folder", ["serve", "--db", "{tmp}"], "--db"),
    ("serve --db in a missing folder", ["serve", "--db", "{tmp}/no/db.sqlite"], "--db"),
    ("serve --log-dir is a file", ["serve", "--db", "{tmp}/db.sqlite", "--log-dir", "{ws}/existing.txt"], "--log-dir"),
    ("serve --nodes without slurm", ["serve", "--nodes", "2"], "--nodes"),
    ("serve --gres without slurm", ["serve", "--gres"], "--gres"),
    ("serve --nodes 0", ["serve", "--launcher", "slurm", "--nodes", "0"], "--nodes"),
    ("serve --max-body-kb 0", ["serve", "--max-body-kb", "0"], "--max-body-kb"),
    ("serve --max-log-mb negative", ["serve", "--max-log-mb", "-1"], "--max-log-mb"),
    ("serve --policy-interval for an event policy", ["serve", "--policy", "fifo-backfill", "--policy-interval", "20"],
     "--policy-interval"),
    ("serve --policy-interval 0", ["serve", "--policy", "pollux", "--policy-interval", "0"], "--policy-interval"),
    ("token create bad name", ["token", "create", "a b"], "user name"),
    ("token create --db is a folder", ["token", "create", "alice", "--db", "{tmp}"], "--db"),
    ("submit unknown kind", ["submit", "xx", TINY, "--batch", "8"], "job kind"),
    ("submit missing model file", ["submit", "fg", "nope.py", "--batch", "8"], "model file"),
    ("submit --batch 0", ["submit", "fg", TINY, "--batch", "0"], "--batch"),
    ("submit --gpus 0", ["submit", "fg", TINY, "--batch", "8", "--gpus", "0"], "--gpus"),
    ("submit without --batch", ["submit", "fg", TINY], "--batch"),
    ("submit --input-shape not numbers", ["submit", "fg", "a.b:c", "--batch", "8", "--input-shape", "3,x"],
     "--input-shape"),
    ("submit --input-dtype unknown", ["submit", "fg", "a.b:c", "--batch", "8", "--input-shape", "3",
                                      "--input-dtype", "int3"], "--input-dtype"),
    ("cancel a job that is not a number", ["cancel", "first"], "job"),
    ("logs a job that is not a number", ["logs", "first"], "job"),
    # replay
    ("replay --jobs 1", ["replay", "workload-6", "--dry-run", "--slots", "2", "--jobs", "1"], "--jobs"),
    ("replay --span 0", ["replay", "workload-6", "--span", "0"], "--span"),
    ("replay --policy magic", ["replay", "workload-6", "--policy", "magic"], "--policy"),
    ("replay --mapping missing", ["replay", "workload-6", "--mapping", "map.json"], "--mapping"),
    ("replay --slots without --dry-run", ["replay", "workload-6", "--slots", "2"], "--slots"),
    ("replay --out is a file", ["replay", "workload-6", "--out", "{ws}/existing.txt"], "--out"),
    ("replay trace missing", ["replay", "nosuch.csv", "--dry-run", "--slots", "2"], "trace file"),
    ("replay --dry-run without --slots", ["replay", "workload-6", "--dry-run"], "--slots"),
    ("replay --policy-interval for an event policy", ["replay", "workload-6", "--policy-interval", "20"],
     "--policy-interval"),
    # the command itself
    ("unknown command", ["plna", TINY], "plna"),
]


@pytest.mark.parametrize(("args", "named"), [(args, named) for _, args, named in MISTAKES],
                         ids=[name for name, _, _ in MISTAKES])
def test_a_mistake_is_one_line_exit_2_naming_the_flag_and_leaves_nothing(capsys, in_tmp, workspace, args, named):
    before = files_under(workspace)
    result = deeppool(capsys, *(arg.format(ws=workspace, tmp=in_tmp) for arg in args))
    lines = result.stderr.strip().splitlines()
    assert result.code == 2, result
    assert "Traceback" not in result.stderr + result.stdout
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert named in lines[0], lines[0]
    assert files_under(in_tmp) == set() and files_under(workspace) == before


def test_the_mistake_table_covers_every_command():
    covered = {args[0] if args[0] != "multiplex" else " ".join(args[:2]) for _, args, _ in MISTAKES}
    assert {"plan", "profile", "run", "simulate", "multiplex bench", "profile-network", "serve", "token", "submit",
            "cancel", "logs", "replay"} <= covered
    assert len(MISTAKES) >= 15 + 40


# -- the console script itself --------------------------------------------------------------------------------
HEAVY = ("torch", "pulp", "matplotlib")


def _loads(*args: str) -> tuple[int, set[str]]:
    """Run ``deeppool ARGS`` in a fresh interpreter: its exit code, and which heavy packages it imported."""
    probe = (
        "import sys\nfrom deeppool.cli import main\n"
        f"try:\n    main({list(args)!r})\nexcept SystemExit as done:\n    code = done.code or 0\nelse:\n    code = 0\n"
        f"print(code, *[name for name in {HEAVY!r} if name in sys.modules])"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60)
    code, *loaded = result.stdout.splitlines()[-1].split()
    return int(code), set(loaded)


def test_help_and_failing_checks_load_no_heavy_package():
    assert _loads("--help") == (0, set())
    assert _loads("plan", "--help") == (0, set())
    assert _loads("plan", TINY, "--gpus", "0") == (2, set())
    assert _loads("plan", TINY, "--gpus", "2", "--time-limit", "-1") == (2, set())
    assert _loads("simulate", "synthetic", "--gpus", "8", "--policy", "magic") == (2, set())
    assert _loads("run", "nope.json") == (2, set())


@pytest.mark.parametrize("group", [[], ["multiplex"], ["token"]], ids=["deeppool", "multiplex", "token"])
def test_a_group_with_no_command_prints_its_help_and_exits_2(capsys, group):
    result = deeppool(capsys, *group)
    assert result.code == 2, result  # what click and typer exit with when no_args_is_help shows the help
    assert "Traceback" not in result.stdout + result.stderr and "Error" not in result.stderr
    assert "Usage:" in result.stdout + result.stderr and "Commands" in result.stdout + result.stderr


def test_plan_help_opens_with_a_two_line_example(capsys):
    lines = [line.strip() for line in deeppool(capsys, "plan", "--help").stdout.splitlines() if line.strip()]
    assert lines[0].startswith("Usage: deeppool plan")
    assert lines[1].startswith("Example:") and lines[2].startswith("deeppool plan examples/vgg16.py --gpus 64")
    assert (ROOT / "examples" / "vgg16.py").is_file()
    assert lines[3].startswith("Trace MODEL")
    listed = deeppool(capsys, "--help").stdout
    assert "Trace MODEL, profile it" in listed and "Example:" not in listed  # the list keeps the one-line summary


def test_plan_help_shows_defaults_and_plain_flags(capsys):
    result = deeppool(capsys, "plan", "--help")
    assert result.code == 0
    assert "--no-memory-limit" in result.stdout and "--no-no-memory-limit" not in result.stdout
    assert "[default: (local)]" in result.stdout  # --device-model's default, measured here
