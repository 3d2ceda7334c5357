"""Imports flow one way: a lower layer never imports a layer built on it.

Every ``import`` and ``from ... import`` in ``deeppool/**/*.py`` counts, those inside functions and under
``TYPE_CHECKING`` included: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import deeppool

PACKAGE = Path(deeppool.__file__).parent
_API, _ENGINE, _TRAINING, _LAUNCH = (f"deeppool.executor.{room}" for room in ("api", "engine", "training", "launch"))
_TOP = tuple(f"deeppool.planner.{module}" for module in
             ("api", "request", "report", "strategies", "pareto", "batch_search", "measure_loop"))
ONLY = {
    "deeppool.plans": ("deeppool.plans", "deeppool.errors"),
    "deeppool.model": ("deeppool.model", "deeppool.plans", "deeppool.errors", "deeppool.device"),
}
"""Layer -> the only parts of deeppool it may import. The plan is the contract everyone reads: it stands on
nothing but the error type. The model (loading, tracing, running layers) stands on the plan alone."""
FORBIDDEN = {
    "deeppool.planner": ("deeppool.cluster_sim", "deeppool.coordinator", "deeppool.executor", "deeppool.multiplex"),
    "deeppool.planner.hardware": ("deeppool.planner.profiling", "deeppool.planner.solve", *_TOP),
    "deeppool.planner.profiling": ("deeppool.planner.solve", *_TOP),
    "deeppool.planner.solve": _TOP,
    "deeppool.scheduling": ("deeppool.cluster_sim",),
    "deeppool.executor": ("deeppool.multiplex", "deeppool.run_command",
                          "deeppool.planner.api", "deeppool.planner.request"),
    "deeppool.executor.config": (_API, _ENGINE, _TRAINING, _LAUNCH),
    "deeppool.executor.engine": (_API, _TRAINING, _LAUNCH),
    "deeppool.executor.training": (_API, _LAUNCH),
    "deeppool.executor.api": (_LAUNCH,),
}
"""Layer -> the layers above it, which it must not import. The planner's two rooms stack one way: ``solve``
(the cost model, the ILP, building a plan) over ``profiling`` (where layer times come from), both over the
device models in ``hardware``; the planner's top (``api``, the request, the searches that re-plan, the report)
drives them. ``deeppool.run_command`` is the command layer where
the executor and the multiplexer are wired together: the worker gets its background work through the
``StartLender`` seam, and a policy's request for another GPU count is re-planned there, not in the executor,
which never drives the planner's top (its api or its request). Inside the executor the rooms stack one way: ``launch`` (processes, the worker, its
commands) over ``api`` (``train_rank``) over ``training`` (the features around the engine) over ``engine`` (one
rank's iteration), all over ``config``."""
DISTRIBUTED = {"deeppool.planner": ("torch.distributed",)}
PROBE = {"deeppool.planner.profiling.netprobe": ("torch.distributed",)}
"""The planner plans in one process and never imports ``torch.distributed``, but for the network probe, which
measures the network through it (gloo ranks that time all-reduces and point-to-point moves)."""
ENTRIES = {"deeppool.executor.__main__": ("deeppool.run_command",)}
"""Programs, not modules of their layer: ``python -m deeppool.executor`` (what torchrun starts) runs the command
layer's worker."""


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level == 0:
        base = node.module or ""
    else:
        package = module.split(".") if is_package else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def _within(name: str, layer: str) -> bool:
    return name == layer or name.startswith(layer + ".")


def _offences(path: Path, root: Path, rules: dict[str, tuple[str, ...]],
              not_yet: dict[str, tuple[str, ...]] | None = None) -> list[str]:
    module = _module_name(path, root)
    excused = (not_yet or {}).get(module, ())
    banned = [above for layer, aboves in rules.items() if _within(module, layer) for above in aboves
              if above not in excused]
    if not banned:
        return []
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = _imported(node, module, path.name == "__init__.py")
        hits = sorted({above for name in names for above in banned if _within(name, above)})
        found += [f"{path.relative_to(root)}:{node.lineno}: {module} imports {above}" for above in hits]
    return found


def _outside(path: Path, root: Path) -> list[str]:
    """Imports of deeppool that ``path``'s layer in :data:`ONLY` does not allow."""
    module = _module_name(path, root)
    allowed = next((parts for layer, parts in ONLY.items() if _within(module, layer)), None)
    if allowed is None:
        return []
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        names = [name for name in _imported(node, module, path.name == "__init__.py")
                 if _within(name, "deeppool") and name != "deeppool"]
        hits = sorted({name for name in names if not any(_within(name, part) for part in allowed)})
        found += [f"{path.relative_to(root)}:{node.lineno}: {module} imports {name}" for name in hits]
    return found


def test_the_plan_and_the_model_stand_on_little() -> None:
    offences = [line for path in sorted(PACKAGE.rglob("*.py")) for line in _outside(path, PACKAGE.parent)]
    assert not offences, "\n".join(offences)


def test_no_layer_imports_a_layer_above_it() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    offences = [line for path in files for line in _offences(path, PACKAGE.parent, FORBIDDEN, ENTRIES)]
    assert not offences, "\n".join(offences)


def test_only_the_network_probe_imports_torch_distributed_in_the_planner() -> None:
    files = sorted((PACKAGE / "planner").rglob("*.py"))
    offences = [line for path in files for line in _offences(path, PACKAGE.parent, DISTRIBUTED, PROBE)]
    assert not offences, "\n".join(offences)


def test_the_check_finds_what_it_looks_for(tmp_path: Path) -> None:
    low = tmp_path / "pkg" / "low"
    low.mkdir(parents=True)
    (low / "__init__.py").write_text("from pkg.high import thing\n")
    (low / "a.py").write_text("import pkg.high.engine\nfrom pkg import high\nfrom pkg.highway import ok\n"
                              "def f():\n    from ..high.models import Choice\n    from . import b\n")
    (low / "excused.py").write_text("import pkg.high\n")
    rules, not_yet = {"pkg.low": ("pkg.high",)}, {"pkg.low.excused": ("pkg.high",)}
    found = [line for path in sorted(low.glob("*.py")) for line in _offences(path, tmp_path, rules, not_yet)]
    assert [line.split(":", 1)[1] for line in found] == [
        "1: pkg.low imports pkg.high",
        "1: pkg.low.a imports pkg.high", "2: pkg.low.a imports pkg.high", "5: pkg.low.a imports pkg.high",
    ]
