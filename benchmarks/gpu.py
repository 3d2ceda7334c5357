"""The GPU checklist: on a machine with GPUs, everything of deeppool that needs one, into one report.

    python benchmarks/gpu.py [--out DIR] [--budget-s 480] [--steps 40] [--dry-run] [--device-model h200]

deeppool has run on one GPU once, a single H200 (``docs/gpu.md`` lists what has run and what has not). The
checks, most decisive first, each passed, failed or skipped (with why), with its figures and the command
it ran; the report is written after every check, and a check that would start after ``--budget-s``
seconds (8 minutes by default) is skipped as "budget spent", so a run cut short still reports what it
measured:

1. ``gpu-tests``: ``pytest -m gpu`` (priority mode on the real GPU, its step cut into layer pieces
   training exactly as the uncut step, the NCCL ``--check``, the
   single-rank NCCL collective, CUDA events, the CUDA profile, dropout's CUDA RNG).
2. ``interference``: the ``priority`` drill (:mod:`deeppool.multiplex.drill`: pieces only in windows,
   never during an all-reduce); then ``deeppool multiplex windows``' sweep (:mod:`deeppool.multiplex.windows`):
   a foreground of products holding windows of 0.5, 1, 2, 5 and 20 ms and one whole phase, its slowdown
   and the background's efficiency in each, written as ``OUT/interference.json`` (``deeppool simulate
   --interference``, ``deeppool plan --objective cluster``); a one-rank plan of ``examples/mixer.py``'s
   natural windows (its data loading and optimizer step, :mod:`deeppool.multiplex.natural`) lent too, into
   the same file; the sweep in ``mps`` mode (:mod:`deeppool.multiplex.mps_windows`, a client process
   beside the foreground) as ``OUT/mps/interference.json``, where ``nvidia-cuda-mps-control`` is on PATH;
   with 2 GPUs, ``deeppool run`` of ``examples/mixer.py`` with
   ``examples/background_mlp.py`` under ``--mux priority`` and ``--mux mps``. Goal: foreground slowdown
   <= 5% with >= 50% of the idle GPU-time recovered.
3. ``device-time``: each example's layers captured as CUDA graphs and replayed at batch 64
   (:mod:`deeppool.planner.profiling.devicetime`), the host's cost per op, and the stage formula's
   forward and backward set beside the recorded H200 runs' (``docs/gpu-runs/2026-11-28-h200/``).
4. ``profiles``: each example profiled on the GPU (``measure_profile``: each layer's device time by graph
   replay, the host's issue time beside it) against the
   device model of this GPU (``h200``, ``h100``, ``a100`` or ``v100`` by name, or ``--device-model``): the
   per-layer relative error of forward + backward at the largest batch, median and worst.
5. ``nccl-vs-ddp``: ``benchmarks/executor.py --backend nccl --skip-burst`` (data-parallel plans
   through the executor against DDP; target executor / DDP <= 1.10): 2 ranks with 2 GPUs; on one GPU a
   single-rank world, which still measures the reducer's overhead against DDP's.
6. ``fidelity``: each example planned for one GPU at batch 64 from a local CUDA profile
   (``--device-model local --local-device cuda``) and run for 30 steps: measured over predicted
   iteration time (goal: within ±15%), and the same over what the device model predicts for
   that plan and over the stage formula's forward and backward from the ``device-time`` check.

``--dry-run`` (on CPU; ``tests/test_gpu_checklist.py`` runs it in CI) takes the same steps through
the fake GPU (:class:`~deeppool.device.fake.FakeGpu`), smaller: the gpu tests are collected (they
import, and their signatures hold), the drill and the window sweep run through the fake for two window
lengths, a one-rank plan of ``examples/background_mlp.py`` lends its natural windows through the fake, the
``mps`` sweep's client is a CPU process under a stand-in MPS control, ``examples/background_mlp.py``'s layers
are captured and replayed through the fake and profiled on CPU against the a100 model, the GPU runs are skipped.
Its figures are not GPU figures, and its goals are not enforced.

The report: ``OUT/gpu-report.json`` and ``OUT/gpu-report.md``. Exit status 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BACKGROUND = REPO / "examples" / "background_mlp.py"
FOREGROUND = REPO / "examples" / "mixer.py"
EXAMPLES = ("mixer.py", "gpt2.py", "resnet50.py", "vgg16.py", "inception.py")
DRY_EXAMPLE = "background_mlp.py"
GPU_TEST_FILES = ("tests/executor/test_executor_gpu.py", "tests/executor/test_executor_timing.py",
                  "tests/multiplex/test_gpu.py", "tests/multiplex/test_pieces.py", "tests/planner/test_profiler.py",
                  "tests/planner/test_randomness.py")
"""Where the gpu-marked tests are (``tests/test_gpu_checklist.py`` checks that no other file has one)."""
SLOWDOWN_GOAL, RECOVERED_GOAL, DDP_RATIO_GOAL, FIDELITY_GOAL = 0.05, 0.50, 1.10, 0.15
BUDGET_S = 480.0
RECORDED = REPO / "docs" / "gpu-runs" / "2026-11-28-h200"
RECORDED_RUN = {"vgg16": "events", "resnet50": "events", "gpt2": "events", "inception": "held", "mixer": "held"}


@dataclass(frozen=True)
class Budget:
    """The checklist's time: a check starts only while some is left (``--budget-s``)."""

    seconds: float
    started: float = field(default_factory=time.perf_counter)

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.started)


@dataclass(kw_only=True)
class Check:
    name: str
    status: str = "passed"
    """passed, failed or skipped."""
    why: str = ""
    figures: dict = field(default_factory=dict)
    commands: list[str] = field(default_factory=list)

    def fail(self, why: str) -> None:
        self.status, self.why = "failed", (self.why + "; " if self.why else "") + why

    def skip(self, why: str) -> None:
        self.status, self.why = "skipped", why


def shell(check: Check, args: list[str], timeout_s: float = 3600.0) -> subprocess.CompletedProcess:
    """Run ``args`` from the repository, record it on ``check``, fail the check on a non-zero exit or when it
    runs past ``timeout_s`` (the budget left: it is stopped, and the checklist goes on to its report)."""
    check.commands.append(" ".join(args))
    paths = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
    try:
        done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=max(1.0, timeout_s),
                              env={**os.environ, "PYTHONPATH": paths}, check=False)
    except subprocess.TimeoutExpired as late:
        check.fail(f"`{' '.join(args[:4])} ...` stopped after {late.timeout:.0f} s (the budget)")
        return subprocess.CompletedProcess(args, -1, _text(late.stdout), _text(late.stderr))
    if done.returncode != 0:
        check.fail(f"`{' '.join(args[:4])} ...` exited {done.returncode}: {(done.stderr or done.stdout)[-500:]}")
    return done


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


# -- 1. the gpu-marked tests ------------------------------------------------------------------------------
def gpu_tests(dry: bool, out: Path, budget: Budget) -> Check:
    check = Check(name="gpu-tests")
    args = [sys.executable, "-m", "pytest", "-q", "-rA", "-m", "gpu", "-p", "no:cacheprovider", *GPU_TEST_FILES]
    done = shell(check, [*args, "--collect-only"] if dry else args, timeout_s=budget.left())
    (out / "gpu-tests.log").write_text(done.stdout + done.stderr)
    found = [line for line in done.stdout.splitlines() if "::" in line]
    check.figures = {"tests": len(found)} if dry else {"summary": done.stdout.strip().splitlines()[-1:]}
    if dry and not found:
        check.fail("no gpu-marked test was collected")
    return check


# -- 2. multiplexing ---------------------------------------------------------------------------------------
def multiplex(dry: bool, gpus: int, out: Path, steps: int, budget: Budget) -> Check:
    check = Check(name="interference")
    drill_check(check, dry)
    for label, measure in (("the window sweep", window_sweep), ("the natural windows", natural_windows),
                           ("the mps sweep", partial(mps_sweep, budget=budget))):
        if budget.left() <= 0:
            check.figures[label] = "budget spent"
            continue
        started = time.perf_counter()
        try:
            measure(check, dry, out)
        except Exception as err:  # noqa: BLE001  one measurement's failure is a finding; the others' figures stay
            check.fail(f"{label}: {type(err).__name__}: {str(err)[-500:]}")
        check.figures.setdefault("seconds_by_part", {})[label] = round(time.perf_counter() - started, 1)
    if dry:
        return check
    if gpus < 2:
        check.figures["runs"] = "skipped: a plan with idle windows needs 2 GPUs"
        return check
    plan = out / "mixer-plan.json"
    shell(check, [sys.executable, "-m", "deeppool.cli", "plan", str(FOREGROUND), "--gpus", "2", "--batch", "32",
                  "--objective", "cluster", "--device-model", "local", "--out", str(plan)], timeout_s=budget.left())
    for mode in ("priority", "mps"):
        run = out / f"run-{mode}"
        shell(check, [sys.executable, "-m", "deeppool.cli", "run", str(plan), "--nproc", "2", "--background",
                      str(BACKGROUND), "--bg-batch", "8", "--mux", mode, "--steps", str(steps), "--out", str(run)],
              timeout_s=budget.left())
        summary = run / "summary.json"
        if summary.exists():
            check.figures[mode] = judged(check, mode, json.loads(summary.read_text())["multiplex"])
    return check


def drill_check(check: Check, dry: bool) -> None:
    import torch

    from deeppool.device.cuda import CudaGpu
    from deeppool.device.fake import FakeGpu
    from deeppool.multiplex.drill import priority_drill, violations

    gpu = FakeGpu() if dry else CudaGpu()
    drill = priority_drill(gpu, torch.device("cpu") if dry else gpu.bind(0), BACKGROUND, windows=8 if dry else 50)
    result = drill.result
    check.figures["drill"] = {"steps": result.steps, "busy_ms": round(1e3 * result.busy_s, 3),
                              "losses": [round(v, 4) for v in result.losses[:3]] + ["..."],
                              "dropped": result.dropped_tokens, "windows": len(drill.windows), "error": result.error}
    if drill.pieces is not None:  # the step's layer pieces: kinds and planned / last expected lengths (ms)
        check.figures["drill"]["pieces"] = [{"kind": kind, "layers": len(layers), "planned_ms": round(planned, 4),
                                             "expected_ms": round(expected, 4)} for kind, layers, planned, expected
                                            in zip(drill.pieces.kinds, drill.pieces.layers, drill.pieces.planned_ms,
                                                   drill.pieces.ms, strict=True)]
    if result.error is not None or not result.losses or result.dropped_tokens < drill.late:
        check.fail(f"the priority drill: error {result.error}, {len(result.losses)} losses, "
                   f"{result.dropped_tokens} dropped of {drill.late} late windows")
    if dry:
        pieces = [(i.start_s or 0.0, i.end_s or 0.0) for i in gpu.log
                  if i.label == "replay" and (i.start_s or 0.0) > drill.windows[0][0]]
        found = violations(pieces, drill)
        check.figures["drill"]["pieces_checked"] = len(pieces)
        if found:
            check.fail("; ".join(found[:3]))


def window_sweep(check: Check, dry: bool, out: Path) -> None:
    """``deeppool multiplex windows``' sweep (:mod:`deeppool.multiplex.windows`): the foreground's slowdown and
    the background's efficiency by window length, written as ``OUT/interference.json`` (``deeppool simulate
    --interference``, ``deeppool plan --objective cluster``)."""
    import torch

    from deeppool.device.cuda import CudaGpu
    from deeppool.device.fake import FakeGpu
    from deeppool.multiplex.windows import WINDOWS_MS, Foreground, sweep, write
    from deeppool.planner.profiling.interference import InterferenceModel

    gpu = FakeGpu() if dry else CudaGpu()
    device = torch.device("cpu") if dry else gpu.bind(0)
    lengths = (WINDOWS_MS[0], 30.0) if dry else WINDOWS_MS
    shape = Foreground(matmuls=2, size=128, windows=3) if dry else Foreground()
    found = sweep(gpu, device, BACKGROUND, lengths, whole=True, foreground=shape)
    check.figures["windows"] = [{"window_ms": round(f.window_ms, 3), "whole": f.whole,
                                 "slowdown": round(f.slowdown, 4), "delay_ms": round(f.delay_ms, 4),
                                 "efficiency": round(f.efficiency, 4)}
                                for f in found]
    path = write(found, out, dry_run=dry)
    InterferenceModel.measured(path)  # what the simulator and the planner will read: refused here if malformed
    check.figures["interference_json"] = str(path)
    worst = max(f.slowdown for f in found)
    if not dry and worst > SLOWDOWN_GOAL:
        check.fail(f"a window slowed the foreground {100 * worst:.1f}% (goal <= {100 * SLOWDOWN_GOAL:.0f}%)")


def natural_windows(check: Check, dry: bool, out: Path) -> None:
    """A one-rank plan's natural windows (:mod:`deeppool.multiplex.natural`: its data loading and its optimizer
    step) lent to the ``priority`` background, added to ``OUT/interference.json`` under ``natural_windows``."""
    import torch

    from deeppool.device.cuda import CudaGpu
    from deeppool.device.fake import FakeGpu
    from deeppool.multiplex.natural import measure_natural
    from deeppool.planner.api import plan_model
    from deeppool.planner.request import CostSource, PlanRequest
    from deeppool.plans import ModelSpec

    example, batch, model = (REPO / "examples" / DRY_EXAMPLE, 16, "a100") if dry else (FOREGROUND, 64, "h200")
    plan = plan_model(ModelSpec.parse(str(example)), PlanRequest(gpus=1, global_batch=batch),
                      CostSource(device_model=model, show_progress=False)).plan  # as `deeppool plan --gpus 1`
    plan.save(out / f"natural-{example.stem}-plan.json")
    gpu = FakeGpu() if dry else CudaGpu()
    device = torch.device("cpu") if dry else gpu.bind(0)
    found = measure_natural(gpu, device, BACKGROUND, plan, iterations=4 if dry else 20)
    check.figures["natural_windows"] = [{"window": f.window.value, "window_ms": round(f.figures.window_ms, 3),
                                         "slowdown": round(f.figures.slowdown, 4),
                                         "efficiency": round(f.figures.efficiency, 4)} for f in found]
    path = out / "interference.json"
    written = json.loads(path.read_text())
    written["natural_windows"] = [f.to_json() for f in found]
    path.write_text(json.dumps(written, indent=2) + "\n")
    worst = max(f.figures.slowdown for f in found)
    if not dry and worst > SLOWDOWN_GOAL:
        check.fail(f"a natural window slowed the foreground {100 * worst:.1f}% (goal <= {100 * SLOWDOWN_GOAL:.0f}%)")


def mps_sweep(check: Check, dry: bool, out: Path, budget: Budget) -> None:
    """The window sweep in ``mps`` mode (:mod:`deeppool.multiplex.mps_windows`: a client process beside the
    foreground), as ``OUT/mps/interference.json``: on a GPU by ``deeppool multiplex windows --mux mps`` in a
    process of its own (its device context must be made under the daemon); dry, in this one, under a
    stand-in for ``nvidia-cuda-mps-control``."""
    import torch

    from deeppool.device.fake import FakeGpu, fake_mps_control
    from deeppool.device.mps import CONTROL, control_available
    from deeppool.multiplex.config import MuxMode
    from deeppool.multiplex.mps_windows import sweep_mps
    from deeppool.multiplex.windows import Foreground, write

    folder = out / "mps"
    folder.mkdir(parents=True, exist_ok=True)
    if not dry:
        if not control_available():
            check.figures["mps"] = f"skipped: {CONTROL} is not on PATH"
            return
        shell(check, [sys.executable, "-m", "deeppool.cli", "multiplex", "windows", "--background", str(BACKGROUND),
                      "--out", str(folder), "--mux", "mps"], timeout_s=budget.left())
        path = folder / "interference.json"
        found = json.loads(path.read_text())["windows"] if path.exists() else []
        check.figures["mps_windows"] = [{key: round(w[key], 4) if isinstance(w[key], float) else w[key]
                                         for key in ("window_ms", "whole", "slowdown", "efficiency")} for w in found]
        check.figures["mps_interference_json"] = str(path)
        return
    calls: list[tuple[str, dict[str, str]]] = []
    gpu = FakeGpu(mps_run=fake_mps_control(calls, folder))
    found = sweep_mps(gpu, torch.device("cpu"), BACKGROUND, folder, (2.0, 30.0), whole=True,
                      foreground=Foreground(matmuls=2, size=128, windows=3), calibrate_s=0.3)
    check.figures["mps_windows"] = [{"window_ms": round(f.window_ms, 3), "whole": f.whole,
                                     "slowdown": round(f.slowdown, 4), "efficiency": round(f.efficiency, 4)}
                                    for f in found]
    check.figures["mps_interference_json"] = str(write(found, folder, dry_run=dry, mode=MuxMode.MPS))
    if [c for c, _ in calls] != [f"{CONTROL} -d", f"{CONTROL} quit"]:
        check.fail(f"the MPS daemon: calls {calls}")


def judged(check: Check, mode: str, mux: dict) -> dict:
    """The goal on one run: slowdown <= 5% and >= 50% of the idle GPU-time recovered."""
    idle = mux["idle_rank_ms_per_iteration"]
    recovered = mux["recovered_fraction"]
    if recovered is None:  # mps runs freely: its background GPU-ms per iteration over the idle rank-ms
        recovered = mux["bg_ms_per_iteration"] / idle if idle > 0 else 0.0
    figures = {"fg_slowdown": mux["fg_slowdown"], "recovered": recovered, "net_gain": mux["net_gain"],
               "bg_errors": mux["bg_errors"]}
    if mux["fg_slowdown"] > SLOWDOWN_GOAL or recovered < RECOVERED_GOAL or mux["bg_errors"]:
        check.fail(f"--mux {mode}: slowdown {100 * mux['fg_slowdown']:.1f}% (goal <= {100 * SLOWDOWN_GOAL:.0f}%), "
                   f"recovered {100 * recovered:.0f}% (goal >= {100 * RECOVERED_GOAL:.0f}%)")
    return figures


# -- 3. NCCL executor vs DDP -------------------------------------------------------------------------------
def nccl_vs_ddp(dry: bool, gpus: int, steps: int, budget: Budget) -> Check:
    """2 ranks with 2 GPUs; on one GPU a single-rank world: the reducer's overhead against DDP's."""
    check = Check(name="nccl-vs-ddp")
    ranks = 1 if gpus == 1 else max(2, min(gpus, 8))
    args = [sys.executable, "benchmarks/executor.py", "--backend", "nccl", "--skip-burst", "--nproc", str(ranks),
            "--steps", str(steps)]
    if dry:
        check.commands.append(" ".join(args))
        check.skip("dry run: needs GPUs")
        return check
    check.figures["ranks"] = ranks
    done = shell(check, args, timeout_s=max(1.0, budget.left()))
    check.figures["report"] = done.stdout.strip().splitlines()[-12:]
    return check


# -- 3. device time per layer against the recorded runs ------------------------------------------------------
def device_time(dry: bool, out: Path, budget: Budget) -> Check:
    """Each example's layers at batch 64 captured and replayed (device time), the host's cost per op, and the
    stage formula's forward and backward beside the recorded H200 run's measured ones (same plan, one stage)."""
    check = Check(name="device-time")
    examples = (DRY_EXAMPLE,) if dry else tuple(f"{m}.py" for m in RECORDED_RUN)
    for name in examples:
        if budget.left() <= 0:
            check.figures[name] = "budget spent"
            continue
        try:
            check.figures[name] = stage_prediction(REPO / "examples" / name, dry, 4 if dry else 64, out)
        except Exception as err:  # noqa: BLE001  one example's failure is a finding, not the end of the list
            check.fail(f"{name}: {type(err).__name__}: {err}")
    return check


def stage_prediction(path: Path, dry: bool, batch: int, out: Path) -> dict:
    """One example's device times by graph replay, the host's cost per op (measured once per host, torch and
    device, kept in ``OUT``), and the stage formula's forward and backward at ``batch``."""
    import torch

    from deeppool.device.cuda import CudaGpu
    from deeppool.device.fake import FakeGpu
    from deeppool.model.layer_exec import runners
    from deeppool.model.loading import load_model
    from deeppool.model.trace import trace
    from deeppool.planner.profiling.devicetime import host_cost, measure_layers, stage_ms
    from deeppool.planner.profiling.passes import Passes
    from deeppool.plans import ModelSpec

    gpu = FakeGpu() if dry else CudaGpu()
    device = torch.device("cpu") if dry else gpu.bind(0)
    loaded = load_model(ModelSpec.parse(str(path)))
    traced = trace(loaded)
    graph = traced.graph
    traced.module.to(device)
    passes = Passes(module=traced.module, graph=graph, runners=runners(traced.module, graph.layers), device=device)
    named = loaded.named_inputs(batch)
    inputs = {n: named[key].to(device) for n, key in zip(graph.inputs, graph.input_keys, strict=True)}
    with gpu.on(device):
        cost = host_cost(out, gpu, device, gpu.name(device))
        found = measure_layers(passes, inputs, batch, gpu, replays=3 if dry else 10)
    names = list(found)
    host = [cost.issue_ms(found[n].fwd_ops, found[n].bwd_ops) for n in names]
    timed = [found[n].device for n in names]
    fwd = stage_ms([h[0] for h in host], [d.fwd_ms if d else 0.0 for d in timed])
    bwd = stage_ms([h[1] for h in reversed(host)], [d.bwd_ms if d else 0.0 for d in reversed(timed)])
    figures = {"batch": batch, "layers": len(names), "captured": sum(1 for d in timed if d and d.captured),
               "host_fwd_op_ms": round(cost.fwd_op_ms, 5), "host_bwd_op_ms": round(cost.bwd_op_ms, 5),
               "device_fwd_ms": round(sum(d.fwd_ms for d in timed if d), 3),
               "device_bwd_ms": round(sum(d.bwd_ms for d in timed if d), 3),
               "host_fwd_ms": round(sum(h[0] for h in host), 3), "host_bwd_ms": round(sum(h[1] for h in host), 3),
               "stage_fwd_ms": round(fwd, 3), "stage_bwd_ms": round(bwd, 3)}
    recorded = RECORDED / RECORDED_RUN.get(path.stem, "") / f"run-{path.stem}.json"
    if path.stem in RECORDED_RUN and recorded.exists() and batch == json.loads(recorded.read_text())["global_batch"]:
        (stage,) = json.loads(recorded.read_text())["stages"]
        figures["recorded_h200"] = {"fwd_measured_ms": round(stage["fwd_measured"], 3),
                                    "bwd_measured_ms": round(stage["bwd_measured"], 3),
                                    "fwd_ratio": round(stage["fwd_measured"] / fwd, 3) if fwd > 0 else None,
                                    "bwd_ratio": round(stage["bwd_measured"] / bwd, 3) if bwd > 0 else None}
    return figures


# -- 4. profiles against the device model ------------------------------------------------------------------
def profiles(dry: bool, gpu_name: str, named: str | None) -> Check:
    from deeppool.planner.hardware import DEVICES, KnownDevice

    check = Check(name="profiles")
    model = KnownDevice(named) if named else next((k for k in KnownDevice if k.value in gpu_name.lower()),
                                                  KnownDevice.A100 if dry else None)
    if model is None:
        check.skip(f"no device model for {gpu_name!r}: name one with --device-model (h200, h100, a100, v100)")
        return check
    examples = (DRY_EXAMPLE,) if dry else EXAMPLES
    for name in examples:
        try:
            check.figures[name] = layer_errors(REPO / "examples" / name, DEVICES[model], "cpu" if dry else "cuda",
                                               batches=(1, 4) if dry else (1, 8, 32))
        except Exception as err:  # noqa: BLE001  one example's failure is a finding, not the end of the list
            check.fail(f"{name}: {type(err).__name__}: {err}")
    check.figures["device_model"] = model.value
    return check


def layer_errors(path: Path, device_model: object, device: str, batches: tuple[int, ...]) -> dict:
    """Median and worst relative error of the device model's fwd+bwd per layer against the measured profile."""
    from deeppool.model.loading import load_model
    from deeppool.model.trace import trace
    from deeppool.plans import ModelSpec
    from deeppool.planner.profiling.profile import estimated_profile
    from deeppool.planner.profiling.profiler import ProfilerConfig, measure_profile

    loaded = load_model(ModelSpec.parse(str(path)))
    traced = trace(loaded)
    measured = measure_profile(traced, loaded, ProfilerConfig(device=device, batches=batches, warmup=2, repeats=3,
                                                              show_progress=False))
    estimated = estimated_profile(traced.graph, device_model, batches)  # type: ignore[arg-type]
    batch = max(batches)
    errors = []
    for name, times in measured.layers.items():
        real = sum(times.at(batch))
        if real > 0:
            errors.append(abs(sum(estimated.layers[name].at(batch)) - real) / real)
    return {"layers": len(errors), "batch": batch, "median_error": round(statistics.median(errors), 3),
            "worst_error": round(max(errors), 3)}


# -- 5. one-GPU fidelity of a local CUDA profile -------------------------------------------------------------
def fidelity(dry: bool, out: Path, gpu_name: str, named: str | None, budget: Budget, device_times: dict) -> Check:
    """Each example planned from a local CUDA profile and run: measured over predicted, over the device model's
    prediction, and over the stage formula's (``device_times``: the ``device-time`` check's figures)."""
    check = Check(name="fidelity")
    if dry:
        check.skip("dry run: needs a GPU")
        return check
    model = named or next((m for m in ("h200", "h100", "a100", "v100") if m in gpu_name.lower()), None)
    for name in EXAMPLES:
        if budget.left() <= 0:
            check.figures[Path(name).stem] = "budget spent"
            continue
        stem = Path(name).stem
        plan, run = out / f"plan-{stem}.json", out / f"run-{stem}"
        shell(check, [sys.executable, "-m", "deeppool.cli", "plan", str(REPO / "examples" / name), "--gpus", "1",
                      "--batch", "64", "--device-model", "local", "--local-device", "cuda", "--out", str(plan)],
              timeout_s=budget.left())
        shell(check, [sys.executable, "-m", "deeppool.cli", "run", str(plan), "--nproc", "1", "--steps", "30",
                      "--out", str(run)], timeout_s=budget.left())
        summary = run / "summary.json"
        if summary.exists():
            found = json.loads(summary.read_text())
            ratio = found["iteration_measured_ms"] / found["iteration_predicted_ms"]
            check.figures[stem] = {"measured_ms": round(found["iteration_measured_ms"], 2),
                                   "predicted_ms": round(found["iteration_predicted_ms"], 2), "ratio": round(ratio, 2)}
            if abs(ratio - 1) > FIDELITY_GOAL:
                check.fail(f"{stem}: measured/predicted {ratio:.2f} (goal within ±{100 * FIDELITY_GOAL:.0f}%)")
            if model is not None and budget.left() > 0:
                check.figures[stem]["device_model_ratio"] = device_model_ratio(check, name, model, out, found, budget)
            check.figures[stem]["device_time_ratio"] = device_time_ratio(found, device_times.get(name))
    return check


def device_time_ratio(measured: dict, stage: object) -> float | None:
    """Measured iteration over the stage formula's forward and backward (the ``device-time`` check's) with the
    rest of the iteration (loss, step) as the plan priced it; None for a plan of more stages or no figures."""
    if not isinstance(stage, dict) or len(measured["stages"]) != 1:
        return None
    priced = measured["stages"][0]
    rest = measured["iteration_predicted_ms"] - priced["fwd_predicted"] - priced["bwd_predicted"]
    return round(measured["iteration_measured_ms"] / (stage["stage_fwd_ms"] + stage["stage_bwd_ms"] + rest), 2)


def device_model_ratio(check: Check, name: str, model: str, out: Path, measured: dict, budget: Budget) -> float | None:
    """Measured iteration over the one the device model ``model`` predicts for the same 1-GPU plan."""
    plan = out / f"plan-{Path(name).stem}-{model}.json"
    shell(check, [sys.executable, "-m", "deeppool.cli", "plan", str(REPO / "examples" / name), "--gpus", "1",
                  "--batch", "64", "--device-model", model, "--out", str(plan)], timeout_s=budget.left())
    if not plan.exists():
        return None
    predicted = json.loads(plan.read_text())["predicted"]["iteration_ms"]
    return round(measured["iteration_measured_ms"] / predicted, 2)


# -- the report --------------------------------------------------------------------------------------------
def markdown(checks: list[Check], header: str) -> str:
    lines = [f"# GPU checklist\n\n{header}\n", "| check | status | why | figures |", "|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {c.name} | {c.status} | {c.why or ''} | `{json.dumps(c.figures, default=str)[:400]}` |")
    lines.append("\nCommands:\n")
    lines += [f"- {c.name}: `{command}`" for c in checks for command in c.commands]
    return "\n".join(lines) + "\n"


def run_checks(dry: bool, out: Path, steps: int, device_model: str | None, budget: Budget,
               header: str) -> list[Check]:
    """The checks in order while the budget lasts (the rest skipped as "budget spent"), the report written
    after each."""
    gpus, name = 0, "fake-gpu (dry run)"
    if not dry:
        from deeppool.device.cuda import CudaGpu

        real = CudaGpu()
        gpus, name = real.count(), real.name(real.current())
    steps_in_order: list[tuple[str, Callable[[], Check]]] = [
        ("gpu-tests", lambda: gpu_tests(dry, out, budget)),
        ("interference", lambda: multiplex(dry, gpus, out, steps, budget)),
        ("device-time", lambda: device_time(dry, out, budget)),
        ("profiles", lambda: profiles(dry, name, device_model)),
        ("nccl-vs-ddp", lambda: nccl_vs_ddp(dry, gpus, steps, budget)),
        ("fidelity", lambda: fidelity(dry, out, name, device_model, budget,
                                      next((c.figures for c in checks if c.name == "device-time"), {}))),
    ]
    checks: list[Check] = []
    for label, step in steps_in_order:
        started = time.perf_counter()
        if budget.left() > 0:
            try:
                check = step()
            except Exception as err:  # noqa: BLE001  a check that raises is a finding; the next checks still run
                check = Check(name=label)
                check.fail(f"{type(err).__name__}: {str(err)[-500:]}")
        else:
            check = Check(name=label)
            check.skip(f"budget spent (--budget-s {budget.seconds:g})")
        check.figures["seconds"] = round(time.perf_counter() - started, 1)
        checks.append(check)
        write_report(out, dry, header, checks)
        print(f"{check.name}: {check.status}{' (' + check.why + ')' if check.why else ''}", flush=True)
    return checks


def gpu_here() -> bool:
    from deeppool.device.cuda import CudaGpu

    return CudaGpu().available()


def write_report(out: Path, dry: bool, header: str, checks: list[Check]) -> None:
    (out / "gpu-report.json").write_text(json.dumps({"dry_run": dry, "header": header,
                                                     "checks": [asdict(c) for c in checks]}, indent=2, default=str))
    (out / "gpu-report.md").write_text(markdown(checks, header))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="where the report and runs go (default: a temporary folder)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                        help="no check starts after this many seconds; the report holds what ran (default 480)")
    parser.add_argument("--dry-run", action="store_true", help="on CPU, through the fake GPU (CI)")
    parser.add_argument("--device-model", choices=("h200", "h100", "a100", "v100"), default=None,
                        help="the device model the profiles are compared with (default: the one the GPU's name names)")
    args = parser.parse_args()
    if args.budget_s < 0:
        raise SystemExit(f"error: --budget-s {args.budget_s:g} must be at least 0")
    if not args.dry_run and not gpu_here():
        raise SystemExit("error: no GPU is visible here: run on a machine with one, or give --dry-run")
    budget = Budget(args.budget_s)
    out = (args.out or Path(tempfile.mkdtemp(prefix="deeppool-gpu-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    header = (f"{'DRY RUN through the fake GPU on CPU: no figure here is a GPU figure. ' if args.dry_run else ''}"
              f"Machine: {os.cpu_count()} CPU cores, load average {load}; budget {args.budget_s:g} s.")
    checks = run_checks(args.dry_run, out, args.steps, args.device_model, budget, header)
    print(f"report: {out / 'gpu-report.md'}")
    if any(c.status == "failed" for c in checks):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
