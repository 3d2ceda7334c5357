"""Hand-made layer graphs and profiles for planner tests (no tracing, no timing)."""

from __future__ import annotations

from deeppool.model.graph import Layer, LayerGraph, TraceMethod
from deeppool.planner.profiling.profile import LayerTimes, Profile

GIB = 1024**3


def layer(name: str, inputs: tuple[str, ...], *, params: int, act: int) -> Layer:
    return Layer(
        name=name, op="Linear", target=name, nodes=(name,), inputs=inputs, output_shape=(act // 4,),
        dtype="float32", params=(f"{name}.weight",) if params else (), param_bytes=params,
        act_bytes=act, fwd_flops=1e6, bwd_flops=2e6,
    )


def graph(spec: list[tuple[str, tuple[str, ...], int, int]]) -> LayerGraph:
    """``spec``: (name, inputs, param bytes, activation bytes per sample) per layer."""
    layers = tuple(layer(name, inputs, params=p, act=a) for name, inputs, p, a in spec)
    return LayerGraph(
        layers=layers, inputs=("x",), input_shapes=((8,),), output=layers[-1].name, method=TraceMethod.FX
    )


def profile(
    graph: LayerGraph, base_ms: dict[str, float], fixed_ms: float, batches: tuple[int, ...],
    memory_bytes: int = 80 * GIB,
) -> Profile:
    """Time = fixed + base·batch forward, twice that backward: layers that scale differently."""
    return Profile(
        device="synthetic",
        source="test",
        dtype="float32",
        memory_bytes=memory_bytes,
        layers={
            name: LayerTimes(
                batches=batches,
                fwd_ms=tuple(fixed_ms + base * b for b in batches),
                bwd_ms=tuple(2 * (fixed_ms + base * b) for b in batches),
            )
            for name, base in base_ms.items()
        },
    )
