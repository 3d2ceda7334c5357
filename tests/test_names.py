"""One name, one thing: no two modules of ``deeppool/`` define a class of the same name, and no class has a
public attribute, field or method whose name is one letter (``engine.p`` said nothing of what it held)."""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import deeppool

PACKAGE = Path(deeppool.__file__).parent


def _modules() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE.parent).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def _top_level_classes(body: list[ast.stmt]) -> Iterator[ast.ClassDef]:
    """The module's own classes, those under a module-level ``if``/``try``/``with`` included."""
    for node in body:
        if isinstance(node, ast.ClassDef):
            yield node
        elif isinstance(node, ast.If | ast.Try | ast.With):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, block, []):
                    yield from _top_level_classes(child.body if isinstance(child, ast.ExceptHandler) else [child])


def _public_one_letter(cls: ast.ClassDef) -> Iterator[tuple[str, int]]:
    """(name, line) of each one-letter public attribute: a class-body field, a method, or ``self.X = ...``."""
    for node in cls.body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Assign):
            targets = node.targets
        for target in targets:
            for name in ast.walk(target):
                if isinstance(name, ast.Name):
                    yield name.id, node.lineno
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node.name, node.lineno
            for sub in ast.walk(node):
                if (isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                        and isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                    yield sub.attr, sub.lineno


def test_every_class_name_is_one_class() -> None:
    where: dict[str, set[str]] = defaultdict(set)
    for module, tree in _modules():
        for cls in _top_level_classes(tree.body):
            where[cls.name].add(module)
    shared = {name: sorted(modules) for name, modules in where.items() if len(modules) > 1}
    assert not shared, f"class names defined in more than one module (name each for what it is): {shared}"


def test_no_public_attribute_has_a_one_letter_name() -> None:
    found = sorted(
        f"{module}:{line}: {cls.name}.{name}"
        for module, tree in _modules()
        for cls in ast.walk(tree) if isinstance(cls, ast.ClassDef)
        for name, line in _public_one_letter(cls)
        if len(name) == 1 and not name.startswith("_")
    )
    assert not found, "one-letter public attributes (give each a name that says what it holds):\n" + "\n".join(found)
