"""How well device time + host issue cost explain the recorded H200 runs, and the device models' per-layer error.

    python benchmarks/gpu_model.py [--write-docs] [--models mixer,vgg16]

Reads ``docs/gpu-runs/2026-11-28-h200/`` (the one GPU run so far: per-layer CUDA profiles of five examples
at batches 1 to 128, and one-GPU runs of a plan made from them at batch 64) and asks two things:

1. **The five runs.** Each run is one stage. Its forward and backward are predicted three ways and set
   beside the measured ones: as recorded (the sum of the profile's per-layer times, each the harness's
   issue time or the device's); the device alone (the ``h200`` device model's roofline, TF32 where PyTorch
   runs it); and the stage formula (:func:`~deeppool.planner.profiling.devicetime.stage_ms`) over that
   device time and the host's issue time per layer, the layer's aten ops (counted on this CPU at batch 1)
   times the host's cost per op. That cost is fitted to the recorded profiles at batch 1, where a layer's
   time is issue time: ``t(1) = a + c·ops`` over every layer of the five models, ``a`` the profiler's own
   harness per layer (events, leaves, a backward call), which the executor does not pay, ``c`` the cost per
   op, which it does. The rest of an iteration (loss, optimizer step) is the recorded plan's.
2. **The device models per layer.** The relative error of each layer's forward + backward against the
   recorded profile at batch 32: the ``h100`` model as it was (fp32 convolutions at the fp32 peak, no host
   floor) and the ``h200`` model (TF32 convolutions, the H200's bandwidth, a host floor per operator: the
   same fit's slope per fx node), over every layer and over the device-bound ones (time at 32 at least
   twice the time at 1).

Five runs cannot prove a model: the figures say how far the recorded data is explained, and the next GPU
run (``benchmarks/gpu.py``'s ``device-time`` check measures device times by graph replay) is the test.
``--write-docs`` writes both tables into ``docs/gpu.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.table import Table

from deeppool.docregions import REPO, Stamp, markdown, write_region
from deeppool.model.graph import LayerGraph
from deeppool.model.layer_exec import runners
from deeppool.model.loading import load_model
from deeppool.model.trace import trace
from deeppool.planner.hardware import DEVICES, KnownDevice
from deeppool.planner.profiling.devicetime import measure_layers, stage_ms
from deeppool.planner.profiling.passes import Passes
from deeppool.planner.profiling.profile import estimate_ms
from deeppool.plans import ModelSpec, Precision

RUNS = REPO / "docs" / "gpu-runs" / "2026-11-28-h200"
MODELS = ("vgg16", "resnet50", "gpt2", "inception", "mixer")
RUN_FOLDER = {"vgg16": "events", "resnet50": "events", "gpt2": "events", "inception": "held", "mixer": "held"}
"""Where each model's recorded run is: inception and mixer ran only on the second try (``held/``)."""
RUN_BATCH, LAYER_BATCH = 64, 32
DOC = REPO / "docs" / "gpu.md"


@dataclass(frozen=True, kw_only=True)
class Model:
    """One recorded model: its traced graph, each layer's aten ops (fwd, bwd) and the recorded profile and run."""

    name: str
    graph: LayerGraph
    ops: dict[str, tuple[int, int]]
    profile: dict
    run: dict

    def times(self, layer: str, batch: int) -> tuple[float, float]:
        entry = self.profile["layers"][layer]
        index = entry["batches"].index(batch)
        return entry["fwd_ms"][index], entry["bwd_ms"][index]


def load(name: str, *, count: bool = True) -> Model:
    """A recorded model, traced here, its ops counted at batch 1 on this CPU (``count``; else none)."""
    loaded = load_model(ModelSpec.parse(str(REPO / "examples" / f"{name}.py")))
    traced = trace(loaded)
    graph = traced.graph
    passes = Passes(module=traced.module, graph=graph, runners=runners(traced.module, graph.layers),
                    device=torch.device("cpu"))
    named = loaded.named_inputs(1)
    inputs = {n: named[key] for n, key in zip(graph.inputs, graph.input_keys, strict=True)}
    counted = measure_layers(passes, inputs, 1, None) if count else {}
    profile = json.loads((RUNS / "events" / f"profile-{name}.json").read_text())
    run = json.loads((RUNS / RUN_FOLDER[name] / f"run-{name}.json").read_text())
    return Model(name=name, graph=graph, ops={n: (c.fwd_ops, c.bwd_ops) for n, c in counted.items()},
                 profile=profile, run=run)


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares ``y = a + c·x`` with ``a, c ≥ 0`` (a negative one is set to 0 and the other refitted)."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread > 0 else 0.0
    intercept = mean_y - slope * mean_x
    if slope < 0:
        return mean_y, 0.0
    if intercept < 0:
        return 0.0, sum(x * y for x, y in points) / sum(x * x for x in xs)
    return intercept, slope


@dataclass(frozen=True, kw_only=True)
class HostFit:
    """``t(1) = a + c·n`` per layer, forward and backward: ``n`` aten ops (``per_op``) or fx nodes (``per_node``)."""

    fwd_harness_ms: float
    fwd_op_ms: float
    bwd_harness_ms: float
    bwd_op_ms: float
    fwd_node_ms: float
    bwd_node_ms: float


def fit_host(models: list[Model]) -> HostFit:
    """The host's cost per op and per node from every layer's recorded time at batch 1 (issue time there)."""
    fwd_ops, bwd_ops = [], []
    for model in models:
        for layer in model.graph.layers:
            fwd, bwd = model.times(layer.name, 1)
            ops = model.ops[layer.name]
            fwd_ops.append((ops[0], fwd))
            if ops[1] > 0:
                bwd_ops.append((ops[1], bwd))
    (fa, fc), (ba, bc) = fit_line(fwd_ops), fit_line(bwd_ops)
    fwd_node, bwd_node = node_floor(models)
    return HostFit(fwd_harness_ms=fa, fwd_op_ms=fc, bwd_harness_ms=ba, bwd_op_ms=bc,
                   fwd_node_ms=fwd_node, bwd_node_ms=bwd_node)


def node_floor(models: list[Model]) -> tuple[float, float]:
    """The host's floor per fx node (ms, forward and backward): the slope of ``t(1) = a + c·nodes`` over every
    recorded layer (the ``h200`` device model's ``host_fwd_op_s`` and ``host_bwd_op_s``)."""
    fwd, bwd = [], []
    for model in models:
        for layer in model.graph.layers:
            times = model.times(layer.name, 1)
            fwd.append((len(layer.nodes), times[0]))
            bwd.append((len(layer.nodes), times[1]))
    return fit_line(fwd)[1], fit_line(bwd)[1]


def device_ms(model: Model, batch: int) -> dict[str, tuple[float, float]]:
    """Each layer's device time from the ``h200`` model's roofline alone (no host floor)."""
    device = DEVICES[KnownDevice.H200]
    roofline = type(device)(**{**device.__dict__, "host_fwd_op_s": 0.0, "host_bwd_op_s": 0.0})
    return {layer.name: estimate_ms(layer, batch, roofline, Precision.FP32) for layer in model.graph.layers}


def slope_ms(model: Model, batch: int) -> dict[str, tuple[float, float]]:
    """Each layer's device time at ``batch`` from the recorded profile's growth: a device-bound layer's time
    doubles with the batch, so ``d(b) ≈ t(2b) − t(b)`` (within ``[0, t(b)]``; a host-bound layer's barely grows)."""
    found = {}
    for layer in model.graph.layers:
        now, double = model.times(layer.name, batch), model.times(layer.name, 2 * batch)
        found[layer.name] = (min(max(double[0] - now[0], 0.0), now[0]), min(max(double[1] - now[1], 0.0), now[1]))
    return found


def explain(model: Model, fit: HostFit) -> dict[str, float]:
    """One recorded run: measured, recorded prediction, device alone, and the stage formula (ms), with the
    device time from the ``h200`` model and from the recorded profile's growth with the batch."""
    (stage,) = model.run["stages"]
    layers = [layer.name for layer in model.graph.layers]
    device = device_ms(model, RUN_BATCH)
    grown = slope_ms(model, RUN_BATCH)
    host = {n: (model.ops[n][0] * fit.fwd_op_ms, model.ops[n][1] * fit.bwd_op_ms) for n in layers}
    rest = model.run["iteration_predicted_ms"] - stage["fwd_predicted"] - stage["bwd_predicted"]
    fwd = stage_ms([host[n][0] for n in layers], [device[n][0] for n in layers])
    bwd = stage_ms([host[n][1] for n in reversed(layers)], [device[n][1] for n in reversed(layers)])
    grown_fwd = stage_ms([host[n][0] for n in layers], [grown[n][0] for n in layers])
    grown_bwd = stage_ms([host[n][1] for n in reversed(layers)], [grown[n][1] for n in reversed(layers)])
    return {
        "measured": model.run["iteration_measured_ms"],
        "recorded": model.run["iteration_predicted_ms"],
        "device": sum(d[0] + d[1] for d in device.values()) + rest,
        "host": sum(h[0] + h[1] for h in host.values()) + rest,
        "stage": fwd + bwd + rest,
        "grown": grown_fwd + grown_bwd + rest,
        "grown_device": sum(d[0] + d[1] for d in grown.values()) + rest,
        "fwd_measured": stage["fwd_measured"], "fwd_stage": grown_fwd,
        "bwd_measured": stage["bwd_measured"], "bwd_stage": grown_bwd,
    }


def layer_errors(model: Model, device: KnownDevice, fit: HostFit | None) -> tuple[list[float], list[float]]:
    """Relative errors of fwd + bwd at ``LAYER_BATCH``: every layer, and the device-bound ones."""
    chosen = DEVICES[device]
    if fit is None:  # the model as it was: fp32 convolutions at the fp32 peak, no host floor
        chosen = type(chosen)(**{**chosen.__dict__, "tf32_convolutions": False})
    else:  # the h200 model with the floor this data gives (the constants are checked against it)
        chosen = type(chosen)(**{**chosen.__dict__, "host_fwd_op_s": fit.fwd_node_ms / 1e3,
                                 "host_bwd_op_s": fit.bwd_node_ms / 1e3})
    every, bound = [], []
    for layer in model.graph.layers:
        real = sum(model.times(layer.name, LAYER_BATCH))
        if real <= 0:
            continue
        error = abs(sum(estimate_ms(layer, LAYER_BATCH, chosen, Precision.FP32)) - real) / real
        every.append(error)
        if real >= 2 * sum(model.times(layer.name, 1)):
            bound.append(error)
    return every, bound


def tables(models: list[Model], fit: HostFit) -> tuple[Table, Table, Table]:
    runs = Table(title=f"The recorded one-GPU runs at batch {RUN_BATCH}: measured over predicted iteration")
    for column in ("model", "measured ms", "as recorded", "h200 model alone", "host alone",
                   "formula: h200 model", "profile growth alone", "formula: profile growth",
                   "fwd: measured / formula (growth) ms", "bwd: measured / formula (growth) ms"):
        runs.add_column(column)
    for model in models:
        found = explain(model, fit)
        runs.add_row(model.name, f"{found['measured']:.1f}",
                     *(f"{found['measured'] / found[k]:.2f}" for k in ("recorded", "device", "host", "stage", "grown_device",
                                                                "grown")),
                     f"{found['fwd_measured']:.1f} / {found['fwd_stage']:.1f}",
                     f"{found['bwd_measured']:.1f} / {found['bwd_stage']:.1f}")
    host = Table(title="The host's cost, fitted to every recorded layer at batch 1: t(1) = a + c·n")
    for column in ("pass", "a: harness per layer ms", "c: per aten op ms", "per fx node ms"):
        host.add_column(column)
    host.add_row("forward", f"{fit.fwd_harness_ms:.4f}", f"{fit.fwd_op_ms:.4f}", f"{fit.fwd_node_ms:.4f}")
    host.add_row("backward", f"{fit.bwd_harness_ms:.4f}", f"{fit.bwd_op_ms:.4f}", f"{fit.bwd_node_ms:.4f}")
    errors = Table(title=f"Device models per layer against the recorded profiles at batch {LAYER_BATCH}: "
                         "relative error of fwd + bwd, median / worst")
    for column in ("model", "layers", "h100 before: all", "h200 after: all", "device-bound layers",
                   "h100 before: device-bound", "h200 after: device-bound"):
        errors.add_column(column)
    for model in models:
        before, before_bound = layer_errors(model, KnownDevice.H100, None)
        after, after_bound = layer_errors(model, KnownDevice.H200, fit)
        errors.add_row(model.name, str(len(before)), _median_worst(before), _median_worst(after),
                       str(len(before_bound)), _median_worst(before_bound), _median_worst(after_bound))
    return runs, host, errors


def _median_worst(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} / {max(values):.2f}" if values else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, of " + ", ".join(MODELS))
    parser.add_argument("--write-docs", action="store_true", help="write the tables into docs/gpu.md")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    parser.add_argument("--node-floor", action="store_true",
                        help="print only the host's floor per fx node (ms, forward and backward) as JSON")
    args = parser.parse_args()
    stamp = Stamp.started()
    names = [n.strip() for n in args.models.split(",")]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        raise SystemExit(f"error: no recorded run of {', '.join(unknown)}: use some of {', '.join(MODELS)}")
    if args.node_floor:
        fwd, bwd = node_floor([load(name, count=False) for name in names])
        print(json.dumps({"fwd_node_ms": fwd, "bwd_node_ms": bwd}))
        return
    models = [load(name) for name in names]
    fit = fit_host(models)
    runs, host, errors = tables(models, fit)
    from rich.console import Console

    for table in (runs, host, errors):
        Console().print(table)
    if args.json is not None:
        args.json.write_text(json.dumps({"fit": fit.__dict__, "runs": {m.name: explain(m, fit) for m in models}},
                                        indent=2) + "\n")
    if args.write_docs:
        write_region(DOC, "gpu-model-runs", "\n\n".join(markdown(t) for t in (runs, host)), stamp)
        write_region(DOC, "gpu-model-layers", markdown(errors), stamp)


if __name__ == "__main__":
    main()
