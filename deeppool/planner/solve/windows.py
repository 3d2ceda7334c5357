"""Short-window cuts: idle time that a costed plan shows cannot hold a guest's piece, priced so for every plan
that keeps its window as short (the cluster search's bound with pieces, :mod:`deeppool.planner.solve.throughput`).

The search's bound counts every idle millisecond of a rank that runs a layer, but with a guest's pieces
(``bg_piece_ms`` = ``p``) a window shorter than ``p`` holds nothing. Which windows are short is not linear in
the plan, so it is learnt from the plans the search costs. In a costed plan, rank group ``j`` (ranks
``low..high − 1``, which run a layer exactly when its count exceeds ``low``) sits out a run of the
schedule's phases between two phases it runs, ``a`` and ``b``. Take any plan ``x`` in which

* the layers of ``a`` and ``b`` still run on more than ``low`` ranks (so ``a`` and ``b`` still bound the
  group's idle time there: both take time on every such count), and
* every layer with a phase between them runs on more than ``low`` ranks or on one of its allowed counts:
  the costed plan's and every faster one, then slower ones, cheapest first, while ``L`` stays under ``p``.

Then every window of group ``j`` between ``a`` and ``b`` in ``x`` is at most ``L``: the phases between at
their longest allowed count, each reshard between two counts the group sits out at its longest (one that
touches ``a``'s or ``b``'s layer is run by the group), and every group's all-reduce rounds and skew that
could fall there. When ``L < p`` the idle time of those phases holds no piece in ``x``. With ``β`` the sum
of the plan's binaries that break one of the two conditions (the endpoints' counts ``≤ low``, the counts of
the layers between that are not allowed) and ``t_φ(x) = Σ_{g ≤ low}
ms_φ(g)·x[l_φ, g]`` the idle time of phase ``φ``, the row

    v_{j,φ} ≥ t_φ(x) − max_{g ≤ low} ms_φ(g) · β

is ``v ≥ t_φ`` where both hold (``β = 0``) and void elsewhere (``β ≥ 1``); the ILP prices ``v_{j,φ}`` at the
group's ranks, so its GPU-time ``B'`` grows by the idle time no piece can use, and the bound stays a bound
(``tests/planner/test_windows.py`` checks it on every assignment of two small graphs).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from deeppool.planner.solve.cost import CostModel, ScheduleSlot

_EPSILON = 1e-12


@dataclass(frozen=True)
class WindowCut:
    """One short window's rows: the idle time of ``idle`` on ranks ``low..low + ranks − 1`` holds no piece
    while none of ``opening`` (layer, count) is chosen."""

    low: int
    ranks: int
    opening: tuple[tuple[str, int], ...]
    idle: tuple[tuple[ScheduleSlot, tuple[tuple[int, float], ...], float], ...]
    """Each deducted phase: its slot, its idle time by count ``≤ low`` and the largest of them."""


@dataclass(frozen=True, kw_only=True)
class WindowCuts:
    """The cuts' fixed part for one search: the slots, the candidate counts and the rounds' slack per group."""

    cost: CostModel
    options: dict[str, tuple[int, ...]]
    gpus: int
    piece_ms: float

    _slack: dict[int, float] = field(default_factory=dict, compare=False, repr=False)
    _ms: dict[tuple[object, ...], float] = field(default_factory=dict, compare=False, repr=False)

    @cached_property
    def slots(self) -> list[ScheduleSlot]:
        """The schedule's slots that take time under some plan."""
        return [slot for slot in self.cost.slots()
                if slot.reshard or any(self.layer_ms(slot, g) > 0 for g in self.options[slot.layer])]

    @cached_property
    def counts(self) -> list[int]:
        return sorted({g for choice in self.options.values() for g in choice})

    def layer_ms(self, slot: ScheduleSlot, g: int) -> float:
        """A layer phase's duration on ``g`` ranks (memoised: the windows ask for the same ones often)."""
        key = (slot, g)
        if key not in self._ms:
            self._ms[key] = self.cost.slot_ms(slot, {slot.layer: g})
        return self._ms[key]

    def reshard_ms(self, slot: ScheduleSlot, src: int, dst: int) -> float:
        key = (slot, src, dst)
        if key not in self._ms:
            self._ms[key] = self.cost.slot_ms(slot, {slot.source: src, slot.layer: dst})
        return self._ms[key]

    def _slack_ms(self, low: int) -> float:
        """All-reduce rounds and skew of every group of at most ``low`` ranks: where they fall is the plan's."""
        if low not in self._slack:
            layers = self.cost.graph.layers
            total = sum(self.cost.param_bytes(layer) for layer in layers)
            self._slack[low] = sum(
                self.cost.rounds_ms(g, total)
                + self.cost.skew_ms(g, sum(sum(self.cost.compute_ms(layer, g)) for layer in layers))
                for g in self.counts if 1 < g <= low)
        return self._slack[low]

    @cached_property
    def _timeless(self) -> dict[ScheduleSlot, int]:
        """Each layer phase's largest count on which it takes no time (0: none)."""
        return {slot: max((g for g in self.options[slot.layer] if self.layer_ms(slot, g) <= 0), default=0)
                for slot in self.slots if not slot.reshard}

    def _endpoint(self, slot: ScheduleSlot, low: int) -> bool:
        """A layer phase that takes time on every count above ``low``: it bounds the group's idle time."""
        return not slot.reshard and self._timeless[slot] <= low

    def of(self, assignment: Mapping[str, int]) -> list[WindowCut]:
        """The cuts of every short window of ``assignment`` (a costed plan) on its busy rank groups."""
        counts, widest = self.counts, max(assignment.values())
        if min(assignment.values()) == widest:
            return []  # one count for every layer: a group runs every phase or none
        found = []
        for k, low in enumerate(counts):
            high = counts[k + 1] if k + 1 < len(counts) else self.gpus
            if high > low and low < widest:
                found += self._group(assignment, low, high - low)
        return found

    def _group(self, assignment: Mapping[str, int], low: int, ranks: int) -> list[WindowCut]:
        """The group's windows between two phases it runs, or between one and the iteration's start or end
        (a group that runs a layer holds whole pieces only inside the iteration: no window wraps)."""
        ends = [i for i, slot in enumerate(self.slots)
                if slot.ranks(assignment) > low and self._endpoint(slot, low)]
        if not ends:
            return []
        bounds = [-1, *ends, len(self.slots)]
        cuts = []
        for a, b in itertools.pairwise(bounds):
            cut = self._window(assignment, low, ranks, a, b)
            if cut is not None:
                cuts.append(cut)
        return cuts

    def _window(self, assignment: Mapping[str, int], low: int, ranks: int, a: int, b: int) -> WindowCut | None:
        inside = self.slots[a + 1:b]
        layers = [slot for slot in inside if not slot.reshard]
        if not layers:
            return None
        ends = {self.slots[i].layer for i in (a, b) if 0 <= i < len(self.slots)}
        window = _Window(self, assignment, low, ends, inside)
        fixed = self._slack_ms(low) + (self.cost.step_call_ms if b == len(self.slots) else 0.0)
        allowed = window.widest(self.piece_ms - fixed)
        if allowed is None:
            return None
        opening = {(name, g) for name in ends for g in self.options[name] if g <= low}
        opening |= {(name, g) for name in window.own for g in self.idle_counts(name, low) if g not in allowed[name]}
        idle = []
        for slot in layers:
            times = tuple((g, self.layer_ms(slot, g)) for g in self.idle_counts(slot.layer, low))
            if any(ms > 0 for _, ms in times):
                idle.append((slot, times, max(ms for _, ms in times)))
        return WindowCut(low=low, ranks=ranks, opening=tuple(sorted(opening)), idle=tuple(idle))

    def idle_counts(self, name: str, low: int) -> list[int]:
        return [g for g in self.options[name] if g <= low]


class _Window:
    """The phases between two that a group runs, and how long their idle time can be when each layer between
    takes one of its allowed counts ``≤ low`` (or a larger one, where the group runs it)."""

    def __init__(self, cuts: WindowCuts, assignment: Mapping[str, int], low: int, ends: set[str],
                 inside: list[ScheduleSlot]) -> None:
        self.cuts, self.assignment, self.low = cuts, assignment, low
        self.layers = [slot for slot in inside if not slot.reshard]
        self.reshards = [slot for slot in inside if slot.reshard and not {slot.layer, slot.source} & ends]
        self.own: dict[str, list[ScheduleSlot]] = {}
        for slot in self.layers:
            self.own.setdefault(slot.layer, []).append(slot)
        self.touching: dict[str, list[ScheduleSlot]] = {}
        for slot in self.reshards:
            for name in {slot.source, slot.layer}:
                self.touching.setdefault(name, []).append(slot)

    def _counts(self, name: str, allowed: dict[str, set[int]]) -> set[int] | list[int]:
        return allowed[name] if name in allowed else self.cuts.idle_counts(name, self.low)

    def _reshard_ms(self, slot: ScheduleSlot, src: Iterable[int], dst: Iterable[int]) -> float:
        return max((self.cuts.reshard_ms(slot, x, y) for x in src for y in dst), default=0.0)

    def longest(self, allowed: dict[str, set[int]]) -> dict[ScheduleSlot, float]:
        """Each phase's longest over its allowed counts; each reshard between two counts the group sits out
        at its longest (one touching an end is run by the group)."""
        found = {slot: max((self.cuts.layer_ms(slot, g) for g in allowed[slot.layer]), default=0.0)
                 for slot in self.layers}
        for slot in self.reshards:
            found[slot] = self._reshard_ms(slot, self._counts(slot.source, allowed), self._counts(slot.layer, allowed))
        return found

    def _grown(self, longest: dict[ScheduleSlot, float], allowed: dict[str, set[int]], name: str, g: int
               ) -> dict[ScheduleSlot, float]:
        """The phases whose longest grows when ``name`` may also take ``g``, with their new longest."""
        found = {slot: ms for slot in self.own[name] if (ms := self.cuts.layer_ms(slot, g)) > longest[slot]}
        for slot in self.touching.get(name, ()):
            src = [g] if slot.source == name else self._counts(slot.source, allowed)
            dst = [g] if slot.layer == name else self._counts(slot.layer, allowed)
            if (ms := self._reshard_ms(slot, src, dst)) > longest[slot]:
                found[slot] = ms
        return found

    def widest(self, budget: float) -> dict[str, set[int]] | None:
        """Allowed counts whose longest run stays under ``budget``: every count no slower than the plan's,
        else the plan's alone, then slower ones, cheapest first, while the run fits (None: nothing fits)."""
        cuts, low = self.cuts, self.low
        plan = {name: {self.assignment[name]} if self.assignment[name] <= low else set() for name in self.own}
        faster = {name: {g for g in cuts.idle_counts(name, low) if all(
            cuts.layer_ms(slot, g) <= cuts.layer_ms(slot, self.assignment[name]) + _EPSILON for slot in own)}
            if plan[name] else set() for name, own in self.own.items()}
        allowed = next((start for start in (faster, plan) if sum(self.longest(start).values()) < budget), None)
        if allowed is None:
            return None
        allowed = {name: set(counts) for name, counts in allowed.items()}
        longest = self.longest(allowed)
        total = sum(longest.values())

        def growth(name: str, g: int, grown: dict[ScheduleSlot, float]) -> float:
            return sum(ms - longest[slot] for slot, ms in grown.items())

        candidates = [(name, g) for name in self.own for g in cuts.idle_counts(name, low) if g not in allowed[name]]
        order = sorted(candidates, key=lambda pair: growth(*pair, self._grown(longest, allowed, *pair)))
        for name, g in order:
            grown = self._grown(longest, allowed, name, g)
            if total + growth(name, g, grown) < budget:
                allowed[name].add(g)
                total += growth(name, g, grown)
                longest.update(grown)
        return allowed
