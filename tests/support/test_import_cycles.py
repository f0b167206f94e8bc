"""No import cycles among the first-party modules, imports inside functions included (issue 32).

An import written inside a function to dodge a cycle still is one: the modules cannot be read,
tested or moved apart.  The graph here is built from the syntax tree (tests/support/source_walk.py reads
imports at any depth), one node per module, so a cycle hidden in a function body fails as surely
as one at the top of a file.  `spectune_protocol` is the wire package both the API and a GPU
host's worker install: it may import the standard library and pydantic, nothing of the service.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from tests.support.source_walk import imported_modules

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("api", "optimizer", "workers", "spectune_sim", "spectune_protocol", "benchmarks", "spectune")
# What the wire package may import besides the standard library (and itself).
PROTOCOL_MAY_IMPORT = frozenset({"pydantic", "pydantic_core", "typing_extensions", "annotated_types"})


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module of `packages` under `root`, by dotted name (a package by its `__init__`)."""
    out: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the first-party modules its imports load, at any depth of the file.

    `from a.b import c` loads the module `a.b.c` when there is one, else `a.b` (c is a name
    defined there, so `a.b` must have run to its end).  Loading `a.b` runs the package `a`'s
    `__init__` first: an edge to each package on the way, except to a package the importing
    module is inside (that one is already running, and Python hands its submodules out)."""
    files = module_files(root, packages)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        explicit: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                explicit.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(module, path, node)
                for alias in node.names:
                    explicit.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base)
        targets: set[str] = set()
        for name in explicit:
            parts = name.split(".")
            if name in files:
                targets.add(name)
            for i in range(1, len(parts)):
                package = ".".join(parts[:i])
                if package in files and not module.startswith(package + "."):
                    targets.add(package)
        graph[module] = targets - {module}
    return graph


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The module a `from ... import` names, relative imports resolved."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None.  Iterative DFS."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path: list[str] = [start]
        iters = [iter(sorted(graph.get(start, ())))]
        state[start] = 1
        while iters:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
                continue
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph.get(nxt, ()))))
    return None


def where_imported(root: Path, module: str, target: str) -> list[str]:
    """'path:line' of each import in `module`'s file that loads `target` (for the failure message)."""
    path = module_files(root, PACKAGES)[module]
    hits = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        if any(n == target or n.startswith(target + ".") for n in names):
            hits.append(f"{path.relative_to(root)}:{node.lineno}")
    return hits


def test_no_import_cycle_among_first_party_modules_functions_included() -> None:
    graph = import_graph(ROOT)
    cycle = find_cycle(graph)
    if cycle is not None:
        where = "; ".join(
            f"{a} -> {b} at {', '.join(where_imported(ROOT, a, b))}" for a, b in zip(cycle, cycle[1:], strict=False)
        )
        raise AssertionError(f"import cycle: {' -> '.join(cycle)} ({where})")


def test_the_wire_package_imports_only_the_standard_library_and_pydantic() -> None:
    stdlib = sys.stdlib_module_names
    bad = []
    for path in sorted((ROOT / "spectune_protocol").rglob("*.py")):
        for name in imported_modules(path):
            top = name.split(".")[0]
            if top in stdlib or top in PROTOCOL_MAY_IMPORT or top == "spectune_protocol" or top == "__future__":
                continue
            bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "spectune_protocol must depend on nothing of the service: " + "; ".join(sorted(set(bad)))


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_cycle_hidden_inside_a_function_is_found(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "api/__init__.py": "",
            "api/errors.py": "def check():\n    from api.auth import authenticate\n",
            "api/auth.py": "from api.errors import AuthError\n",
        },
    )
    assert find_cycle(import_graph(tmp_path, ("api",))) == ["api.auth", "api.errors", "api.auth"]


def test_a_package_importing_its_own_module_is_no_cycle_but_a_module_importing_a_name_back_is(
    tmp_path: Path,
) -> None:
    _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.leases import LeaseOut\n",
            "pkg/leases.py": "from pkg.names import NAME\n",
            "pkg/names.py": "NAME = 1\n",
        },
    )
    assert find_cycle(import_graph(tmp_path, ("pkg",))) is None
    # A module of the package naming the package itself runs its `__init__`, which imports it.
    (tmp_path / "pkg/names.py").write_text("from pkg import LeaseOut\n")
    assert find_cycle(import_graph(tmp_path, ("pkg",))) == ["pkg", "pkg.leases", "pkg.names", "pkg"]


def test_imports_across_packages_make_one_graph(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "wire/__init__.py": "from core.settings import Settings\n",
            "core/__init__.py": "",
            "core/settings.py": "X = 1\n",
            "core/conductor.py": "import wire\n",
        },
    )
    assert find_cycle(import_graph(tmp_path, ("wire", "core"))) is None
    (tmp_path / "core/settings.py").write_text("def f():\n    import core.conductor\n")
    assert find_cycle(import_graph(tmp_path, ("wire", "core"))) == [
        "core.conductor",
        "wire",
        "core.settings",
        "core.conductor",
    ]
