"""The GPU checklist: on a machine with GPUs, everything of deeppool that needs one, into one report.

    python benchmarks/gpu.py [--out DIR] [--steps 40] [--dry-run] [--device-model h100]

deeppool has run on one GPU once, a single H200 (``docs/gpu.md``); nothing with two GPUs has run. The
checks, in order, each passed, failed or skipped (with why), with its figures and the command it ran:

1. ``gpu-tests``: ``pytest -m gpu`` (priority mode on the real GPU, its step cut into layer pieces
   training exactly as the uncut step, the NCCL ``--check``, the
   single-rank NCCL collective, CUDA events, the CUDA profile, dropout's CUDA RNG).
2. ``multiplex``: the ``priority`` drill (:mod:`deeppool.multiplex.drill`: pieces only in windows, never
   during an all-reduce), then ``deeppool run`` of ``examples/mixer.py`` planned for the GPUs here
   with ``examples/background_mlp.py`` under ``--mux priority`` and ``--mux mps``. Goal: foreground
   slowdown <= 5% with >= 50% of the idle GPU-time recovered (``mps`` runs freely: its background
   GPU-ms per iteration over the idle rank-ms). Needs 2 GPUs for a plan with idle windows.
3. ``nccl-vs-ddp``: ``benchmarks/executor.py --backend nccl --skip-burst`` (data-parallel plans
   through the executor against DDP; target executor / DDP <= 1.10). Needs 2 GPUs.
4. ``profiles``: each example profiled on the GPU (``measure_profile``, CUDA events) against the
   device model of this GPU (``h100``, ``a100`` or ``v100`` by name, or ``--device-model``): the
   per-layer relative error of forward + backward at the largest batch, median and worst.
5. ``fidelity``: each example planned for one GPU at batch 64 from a local CUDA profile
   (``--device-model local --local-device cuda``) and run for 30 steps: measured over predicted
   iteration time (goal: within ±15%), and the same over what the device model predicts for
   that plan.

``--dry-run`` (on CPU; ``tests/test_gpu_checklist.py`` runs it in CI) takes the same steps through
the fake GPU (:class:`~deeppool.device.fake.FakeGpu`), smaller: the gpu tests are collected (they
import, and their signatures hold), the drill runs through the fake and the MPS daemon starts and
stops with a stand-in control, the GPU runs are skipped, ``examples/background_mlp.py`` is profiled
on CPU against the a100 model. Its figures are not GPU figures, and its goals are not enforced.

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
    """Run ``args`` from the repository, record it on ``check``, fail the check on a non-zero exit."""
    check.commands.append(" ".join(args))
    paths = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "PYTHONPATH": paths})
    if done.returncode != 0:
        check.fail(f"`{' '.join(args[:4])} ...` exited {done.returncode}: {(done.stderr or done.stdout)[-500:]}")
    return done


# -- 1. the gpu-marked tests ------------------------------------------------------------------------------
def gpu_tests(dry: bool, out: Path) -> Check:
    check = Check(name="gpu-tests")
    args = [sys.executable, "-m", "pytest", "-q", "-rA", "-m", "gpu", "-p", "no:cacheprovider", *GPU_TEST_FILES]
    done = shell(check, [*args, "--collect-only"] if dry else args)
    (out / "gpu-tests.log").write_text(done.stdout + done.stderr)
    found = [line for line in done.stdout.splitlines() if "::" in line]
    check.figures = {"tests": len(found)} if dry else {"summary": done.stdout.strip().splitlines()[-1:]}
    if dry and not found:
        check.fail("no gpu-marked test was collected")
    return check


# -- 2. multiplexing ---------------------------------------------------------------------------------------
def multiplex(dry: bool, gpus: int, out: Path, steps: int) -> Check:
    check = Check(name="multiplex")
    drill_check(check, dry)
    if dry:
        mps_dry(check, out)
        return check
    if gpus < 2:
        check.figures["runs"] = "skipped: a plan with idle windows needs 2 GPUs"
        return check
    plan = out / "mixer-plan.json"
    shell(check, [sys.executable, "-m", "deeppool.cli", "plan", str(FOREGROUND), "--gpus", "2", "--batch", "32",
                  "--objective", "cluster", "--device-model", "local", "--out", str(plan)])
    for mode in ("priority", "mps"):
        run = out / f"run-{mode}"
        shell(check, [sys.executable, "-m", "deeppool.cli", "run", str(plan), "--nproc", "2", "--background",
                      str(BACKGROUND), "--bg-batch", "8", "--mux", mode, "--steps", str(steps), "--out", str(run)])
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


def mps_dry(check: Check, out: Path) -> None:
    """The MPS daemon's start and stop with a stand-in for ``nvidia-cuda-mps-control`` (on PATH for the check)."""
    from deeppool.device.fake import FakeGpu, fake_mps_control
    from deeppool.device.mps import CONTROL

    calls: list[tuple[str, dict[str, str]]] = []
    stand_in = out / "bin" / CONTROL
    stand_in.parent.mkdir(parents=True, exist_ok=True)
    stand_in.write_text("#!/bin/sh\nexit 0\n")
    stand_in.chmod(0o755)
    saved = os.environ["PATH"]
    os.environ["PATH"] = f"{stand_in.parent}:{saved}"
    try:
        with FakeGpu(mps_run=fake_mps_control(calls, out)).mps_daemon() as daemon:
            up = (daemon.pipe / "control").exists()
    finally:
        os.environ["PATH"] = saved
    check.figures["mps_daemon"] = [command for command, _ in calls]
    if not up or [c for c, _ in calls] != [f"{CONTROL} -d", f"{CONTROL} quit"]:
        check.fail(f"the MPS daemon: up {up}, calls {calls}")


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
def nccl_vs_ddp(dry: bool, gpus: int, steps: int) -> Check:
    check = Check(name="nccl-vs-ddp")
    args = [sys.executable, "benchmarks/executor.py", "--backend", "nccl", "--skip-burst", "--nproc", str(max(2, min(gpus, 8))),
            "--steps", str(steps)]
    if dry or gpus < 2:
        check.commands.append(" ".join(args))
        check.skip("needs 2 GPUs" if not dry else "dry run: needs GPUs")
        return check
    done = shell(check, args)
    check.figures["report"] = done.stdout.strip().splitlines()[-12:]
    return check


# -- 4. profiles against the device model ------------------------------------------------------------------
def profiles(dry: bool, gpu_name: str, named: str | None) -> Check:
    from deeppool.planner.hardware import DEVICES, KnownDevice

    check = Check(name="profiles")
    model = KnownDevice(named) if named else next((k for k in KnownDevice if k.value in gpu_name.lower()),
                                                  KnownDevice.A100 if dry else None)
    if model is None:
        check.skip(f"no device model for {gpu_name!r}: name one with --device-model (h100, a100, v100)")
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
def fidelity(dry: bool, out: Path, gpu_name: str, named: str | None) -> Check:
    check = Check(name="fidelity")
    if dry:
        check.skip("dry run: needs a GPU")
        return check
    model = named or next((m for m in ("h100", "a100", "v100") if m in gpu_name.lower()), None)
    for name in EXAMPLES:
        stem = Path(name).stem
        plan, run = out / f"plan-{stem}.json", out / f"run-{stem}"
        shell(check, [sys.executable, "-m", "deeppool.cli", "plan", str(REPO / "examples" / name), "--gpus", "1",
                      "--batch", "64", "--device-model", "local", "--local-device", "cuda", "--out", str(plan)])
        shell(check, [sys.executable, "-m", "deeppool.cli", "run", str(plan), "--nproc", "1", "--steps", "30",
                      "--out", str(run)])
        summary = run / "summary.json"
        if summary.exists():
            found = json.loads(summary.read_text())
            ratio = found["iteration_measured_ms"] / found["iteration_predicted_ms"]
            check.figures[stem] = {"measured_ms": round(found["iteration_measured_ms"], 2),
                                   "predicted_ms": round(found["iteration_predicted_ms"], 2), "ratio": round(ratio, 2)}
            if abs(ratio - 1) > FIDELITY_GOAL:
                check.fail(f"{stem}: measured/predicted {ratio:.2f} (goal within ±{100 * FIDELITY_GOAL:.0f}%)")
            if model is not None:
                check.figures[stem]["device_model_ratio"] = device_model_ratio(check, name, model, out, found)
    return check


def device_model_ratio(check: Check, name: str, model: str, out: Path, measured: dict) -> float | None:
    """Measured iteration over the one the device model ``model`` predicts for the same 1-GPU plan."""
    plan = out / f"plan-{Path(name).stem}-{model}.json"
    shell(check, [sys.executable, "-m", "deeppool.cli", "plan", str(REPO / "examples" / name), "--gpus", "1",
                  "--batch", "64", "--device-model", model, "--out", str(plan)])
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


def run_checks(dry: bool, out: Path, steps: int, device_model: str | None) -> list[Check]:
    from deeppool.device.cuda import CudaGpu

    real = CudaGpu()
    gpus = 0 if dry else real.count()
    name = "fake-gpu (dry run)" if dry else real.name(real.current())
    steps_in_order: list[Callable[[], Check]] = [
        lambda: gpu_tests(dry, out),
        lambda: multiplex(dry, gpus, out, steps),
        lambda: nccl_vs_ddp(dry, gpus, steps),
        lambda: profiles(dry, name, device_model),
        lambda: fidelity(dry, out, name, device_model),
    ]
    checks = []
    for step in steps_in_order:
        started = time.perf_counter()
        check = step()
        check.figures["seconds"] = round(time.perf_counter() - started, 1)
        checks.append(check)
        print(f"{check.name}: {check.status}{' (' + check.why + ')' if check.why else ''}", flush=True)
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="where the report and runs go (default: a temporary folder)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--dry-run", action="store_true", help="on CPU, through the fake GPU (CI)")
    parser.add_argument("--device-model", choices=("h100", "a100", "v100"), default=None,
                        help="the device model the profiles are compared with (default: the one the GPU's name names)")
    args = parser.parse_args()
    from deeppool.device.cuda import CudaGpu

    if not args.dry_run and not CudaGpu().available():
        raise SystemExit("error: no GPU is visible here: run on a machine with one, or give --dry-run")
    out = (args.out or Path(tempfile.mkdtemp(prefix="deeppool-gpu-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    header = (f"{'DRY RUN through the fake GPU on CPU: no figure here is a GPU figure. ' if args.dry_run else ''}"
              f"Machine: {os.cpu_count()} CPU cores, load average {load}.")
    checks = run_checks(args.dry_run, out, args.steps, args.device_model)
    (out / "gpu-report.json").write_text(json.dumps({"dry_run": args.dry_run, "header": header,
                                                     "checks": [asdict(c) for c in checks]}, indent=2, default=str))
    (out / "gpu-report.md").write_text(markdown(checks, header))
    print(f"report: {out / 'gpu-report.md'}")
    if any(c.status == "failed" for c in checks):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
