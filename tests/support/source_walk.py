"""What the structure tests read of the source, without importing it: the modules a file's imports
name, the import cycles among the service modules, and the places that write a study's life.

They read the syntax tree, so an import inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement of `path` names, at any depth (function-level ones too).

    `from a.b import c` names both `a.b` and `a.b.c` (c may be a module).  Relative imports are
    left out: the packages checked here use none."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def unit_of(module: str, package: str) -> str | None:
    """The unit of `package` a module belongs to: a module right under it, or a whole subpackage."""
    parts = module.split(".")
    depth = len(package.split("."))
    if module == package or parts[:depth] != package.split("."):
        return None
    return ".".join(parts[: depth + 1])


def import_cycle(root: Path, package: str) -> list[str] | None:
    """One cycle of imports among the units of `package` under `root` (None when there is none).

    A subpackage is one unit: `leasing` importing `study_life` while `study_life` imports
    `leasing.records` is a cycle, though no single module imports itself back."""
    folder = root.joinpath(*package.split("."))
    edges: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        module = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        here = unit_of(module, package)
        if here is None:
            continue
        targets = {unit_of(m, package) for m in imported_modules(path)}
        edges.setdefault(here, set()).update(t for t in targets if t is not None and t != here)
    return _first_cycle(edges)


def _first_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        for nxt in sorted(edges.get(node, ())):
            found = visit(nxt, path + [node])
            if found is not None:
                return found
        done.add(node)
        return None

    for start in sorted(edges):
        found = visit(start, [])
        if found is not None:
            return found
    return None


# A study's life as its row stores it (api.models.StudyRow).
LIFE_COLUMNS = frozenset({"state", "phase", "finished_at", "finish_reason", "finish_rule", "confirmation_began_at"})


def study_life_writes(path: Path) -> list[str]:
    """Where `path` writes a study's life: a life column set on a name bound to a `StudyRow`
    (from an expression naming it, a loop over one, a parameter annotated with it), or an
    `update(StudyRow)`.  'LINE: SOURCE' each."""
    source = path.read_text()
    tree = ast.parse(source, str(path))
    rows = _names_bound_to(tree, "StudyRow")
    hits: set[int] = set()  # line numbers
    for node in ast.walk(tree):
        targets: Iterable[ast.expr] = ()
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        for t in targets:
            for leaf in ast.walk(t):  # `row.state, row.phase = ...` too
                if (
                    isinstance(leaf, ast.Attribute)
                    and leaf.attr in LIFE_COLUMNS
                    and isinstance(leaf.value, ast.Name)
                    and leaf.value.id in rows
                ):
                    hits.add(node.lineno)
        if isinstance(node, ast.Call) and _called(node) == "update" and node.args and _names(node.args[0], "StudyRow"):
            hits.add(node.lineno)
    lines = source.splitlines()
    return [f"{n}: {lines[n - 1].strip()}" for n in sorted(hits)]


def _names(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def _called(call: ast.Call) -> str | None:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None


def _names_bound_to(tree: ast.AST, cls: str) -> set[str]:
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.NamedExpr) and node.value is not None:
            if _names(node.value, cls) or (isinstance(node, ast.AnnAssign) and _names(node.annotation, cls)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                bound |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.For | ast.comprehension) and _names(node.iter, cls):
            bound |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.arg) and node.annotation is not None and _names(node.annotation, cls):
            bound.add(node.arg)
    return bound
