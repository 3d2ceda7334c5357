"""The real-tensor tracer: torch.export with real values beside the fake ones, for branches on values.

``torch.export.draft_export`` traces like ``torch.export`` but carries each tensor's real value from the
given inputs; where the model's code branches on a value (``if label_index.size(0) > 0:``, LayerDrop's
``if torch.rand([]) < self.layerdrop:``) it takes the way the real value goes and reports the expression,
where and which way. The graph is then the model *specialised* on those ways: each is a
:class:`~deeppool.plans.Branch` that the plan lists and ``run --check`` verifies every step.

A random draw compared with a constant (``torch.rand([]) < p``) is LayerDrop: with ``p`` strictly between
0 and 1 it goes both ways from step to step, so no specialised graph is the model, and it is refused.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch._logging import structured

from deeppool.errors import DeeppoolError
from deeppool.plans import Branch

_COMPARISONS = {
    torch.ops.aten.lt.Scalar, torch.ops.aten.le.Scalar, torch.ops.aten.gt.Scalar, torch.ops.aten.ge.Scalar,
}
_DRAWS = {torch.ops.aten.rand.default, torch.ops.aten.rand_like.default}
_SYMBOL = re.compile(r"\bu\d+\b")


@dataclass(frozen=True)
class RealExport:
    """The exported module and the branches on values it was specialised on, in the order they ran."""

    module: fx.GraphModule
    branches: tuple[Branch, ...]


def real_export(model: nn.Module, kwargs: Mapping[str, Any], dynamic: Mapping[str, Any]) -> RealExport:
    """Export ``model`` on ``kwargs`` (batch dimension ``dynamic``), branches on values taken as the values go.

    Only branches outside any submodule (in the root's ``forward``, its loss) or on a random draw are
    specialised: one on values inside a submodule (routing) is :class:`InsideModule`, for that submodule
    to run eagerly as an opaque layer. Raises the tracer's own exception when it cannot export even so;
    a :class:`DeeppoolError` for a branch on a random draw that goes both ways, or when the export had
    to fix what it was asked to keep dynamic (the batch).
    """
    program = torch.export.draft_export(model, (), kwargs=dict(kwargs), dynamic_shapes=dict(dynamic), strict=False)
    report = program._report
    branches = []
    for failure in report.failures:
        kind = failure.failure_type.name
        if kind == "CONSTRAINT_VIOLATION_ERROR":
            raise DeeppoolError(f"the real-tensor tracer had to fix the batch size ({_first(failure.data)})")
        if kind != "DATA_DEPENDENT_ERROR":
            continue
        frame = failure.data["user_stack"][-1]
        where = (_filename(report.str_to_filename, frame["filename"]), int(frame["line"]))
        expression = str(failure.data.get("expr", ""))
        branches.append((Branch(file=where[0], line=where[1], taken=str(failure.data.get("result")) == "True"),
                         set(_SYMBOL.findall(expression))))
    module = program.module()
    drawn, root = _drawn_symbols(module), _root_lines(model)
    for branch, symbols in branches:
        if not (symbols and symbols <= drawn) and (branch.file, branch.line) not in root:
            raise InsideModule(branch)
    _refuse_random_both_ways(module, tuple(branch for branch, _ in branches))
    return RealExport(module=module, branches=tuple(branch for branch, _ in branches))


class InsideModule(DeeppoolError):
    """A branch on a value inside a submodule: not specialised (it would change with the rows a rank holds)."""

    def __init__(self, branch: Branch) -> None:
        super().__init__(f"a value-dependent branch at {branch.file}:{branch.line} inside a submodule")
        self.branch = branch


def _filename(logged: Mapping[int, str], index: Any) -> str:
    """A frame's file: the report names a file by its index in torch's table of logged strings, and logs the
    name itself only the first time a process meets it."""
    if index in logged:
        return logged[index]
    names = {number: name for name, number in structured.INTERN_TABLE.items()}
    return names.get(index, str(index))


def _root_lines(model: nn.Module) -> set[tuple[str, int]]:
    """The file and lines of the root's own ``forward``."""
    try:
        lines, start = inspect.getsourcelines(type(model).forward)
        return {(inspect.getsourcefile(type(model).forward) or "", start + i) for i in range(len(lines))}
    except (OSError, TypeError):
        return set()


def _drawn_symbols(module: fx.GraphModule) -> set[str]:
    """The unbacked symbols (``u0``...) of values read out of tensors computed from a random draw."""
    drawn: set[str] = set()
    from_draw: set[str] = set()
    for node in module.graph.nodes:
        if node.target in _DRAWS or any(arg.name in from_draw for arg in node.all_input_nodes):
            from_draw.add(node.name)
            if node.target in (torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default):
                drawn |= set(_SYMBOL.findall(str(node.meta.get("val", ""))))
    return drawn


def _refuse_random_both_ways(module: fx.GraphModule, branches: tuple[Branch, ...]) -> None:
    """A draw in [0, 1) compared with ``p`` strictly between 0 and 1 goes both ways: LayerDrop above 0."""
    for node in module.graph.nodes:
        if node.target not in _COMPARISONS or len(node.args) < 2:
            continue
        source, bound = node.args[0], node.args[1]
        if isinstance(source, fx.Node) and source.target in _DRAWS and isinstance(bound, float | int) \
                and 0.0 < float(bound) < 1.0:
            where = f" at {branches[0].file}:{branches[0].line}" if branches else ""
            raise DeeppoolError(
                f"a branch on a random draw{where} compares it with {bound} (LayerDrop above 0): it goes both "
                "ways, so the layers would change from step to step; set its probability to 0"
            )


def _first(data: Mapping[str, Any]) -> str:
    text = str(data.get("expr") or data.get("reason") or data).strip()
    return text.splitlines()[0] if text else "no message"
