"""Pinned GPU counts: ``deeppool plan --pin 'GLOB=N'`` fixes the layers whose names match.

A pin narrows the matching layers' candidate counts to the one count ``N``;
the ILP solves the rest exactly as before, so the plan is the optimum among
the layouts that honour the pins. Patterns are shell globs
(:func:`fnmatch.fnmatchcase` on the traced layer names, e.g. ``layer4.*``);
a layer matched by several pins must get the same count from each, and the
layers sharing a parameter with a pinned layer take its count too (one
count per shared gradient). A pin that matches no layer, asks for more GPUs
than the plan has or than there are samples, breaks the amplification limit
or leaves rank 0 out of memory is refused with one line naming the layer.
"""

from __future__ import annotations

from deeppool.errors import DeeppoolError
from deeppool.plans import Pin
from deeppool.planner.hardware import GIB
from deeppool.planner.solve.candidates import Limits, allowed_counts
from deeppool.planner.solve.cost import CostModel


def pinned_counts(cost: CostModel, pins: tuple[Pin, ...], gpus: int) -> dict[str, int]:
    """Each pinned layer's count (tied layers included), refusing unmatched, clashing or impossible pins."""
    fixed: dict[str, tuple[int, Pin]] = {}
    for pin in pins:
        if pin.gpus > min(gpus, cost.global_batch):
            limit = "--gpus" if gpus <= cost.global_batch else "the global batch (one sample per GPU)"
            raise DeeppoolError(f"--pin '{pin}': {pin.gpus} GPUs is more than {limit}, {min(gpus, cost.global_batch)}")
        names = [layer.name for layer in cost.graph.layers if pin.matches(layer.name)]
        if not names:
            raise DeeppoolError(f"--pin '{pin}' matches no layer: `deeppool plan --per-layer` lists their names")
        for name in names:
            _fix(fixed, name, pin)
    for group in cost.graph.tied():
        held = [fixed[name] for name in group if name in fixed]
        for name in group:
            if held:
                _fix(fixed, name, held[0][1])
    return {name: gpus for name, (gpus, _) in fixed.items()}


def _fix(fixed: dict[str, tuple[int, Pin]], name: str, pin: Pin) -> None:
    if name in fixed and fixed[name][0] != pin.gpus:
        raise DeeppoolError(
            f"layer '{name}' is pinned to {fixed[name][0]} GPUs by --pin '{fixed[name][1]}' and to {pin.gpus} "
            f"by --pin '{pin}' (or a layer sharing its parameters): pin it once"
        )
    fixed.setdefault(name, (pin.gpus, pin))


def apply_pins(
    cost: CostModel, options: dict[str, tuple[int, ...]], pinned: dict[str, int], limits: Limits
) -> dict[str, tuple[int, ...]]:
    """``options`` with every pinned layer narrowed to its count; a pin over a hard limit names its layer.

    The other layers may also take the pinned counts (within the limits): a pinned count need not be one of
    the useful counts, and the lossless pruning of :mod:`deeppool.planner.solve.candidates` maps each free count to
    the smallest with its per-GPU batch *unless it equals a pinned count*. That map still sends equal counts
    to equal counts and never raises a term, so the optimum over these options is the optimum over all counts.
    """
    bound = None if limits.amplification is None else limits.amplification + 1e-9
    for name, g in pinned.items():
        amplification = cost.amplification(cost.graph.layer(name), g)
        if bound is not None and g > 1 and amplification > bound:
            raise DeeppoolError(
                f"pinned layer '{name}' on {g} GPUs has amplification {amplification:.2f}, above --amplification "
                f"{limits.amplification:g}: pin it to fewer GPUs or relax the limit"
            )
    extra = tuple(sorted(set(pinned.values())))
    narrowed = {
        layer.name: (pinned[layer.name],) if layer.name in pinned
        else tuple(sorted(set(options[layer.name]) | set(allowed_counts(cost, layer, extra, limits))))
        for layer in cost.graph.layers
    }
    _check_pinned_memory(cost, narrowed, pinned, limits)
    return narrowed


def _check_pinned_memory(
    cost: CostModel, options: dict[str, tuple[int, ...]], pinned: dict[str, int], limits: Limits
) -> None:
    """Rank 0 holds every layer: the pinned layers at their counts and the rest at their least must fit."""
    if limits.memory_bytes is None or not pinned:
        return
    needs = {layer.name: min(cost.memory_bytes(layer, g) for g in options[layer.name]) for layer in cost.graph.layers}
    total = sum(needs.values())
    if total <= limits.memory_bytes:
        return
    worst = max(pinned, key=needs.__getitem__)
    raise DeeppoolError(
        f"pinned layer '{worst}' on {pinned[worst]} GPUs needs {needs[worst] / GIB:.2f} GiB per rank, and with it "
        f"rank 0 needs at least {total / GIB:.2f} GiB of the device's {limits.memory_bytes / GIB:.2f} GiB: "
        "pin it to more GPUs, lower --batch or add GPUs"
    )
