"""The simulation benchmarks run the service's own procedure from optimizer/ (the conductor, its
actions over the in-memory store, the rehearsal) and import nothing of the service (api/): what
they measure is not a copy of the service kept beside it (issue 32).  Read from the syntax tree,
so an import inside a function counts too (tests/support/source_walk.py)."""

from __future__ import annotations

from pathlib import Path

from tests.support.source_walk import imported_modules

ROOT = Path(__file__).resolve().parents[2]
# These two measure the running service itself (its HTTP API under load, its recovery from
# crashes): they start it, mint its tokens and read its tables, so they import api/ by design.
SERVICE_BENCHMARKS = {"api_load.py", "chaos.py"}
# The store, the actions and the rehearsal: the service and the benchmarks both import them, so
# they import neither the service nor the worker (whose own code a rehearsal is handed).
SHARED = ("store.py", "memory_store.py", "actions.py", "rehearsal.py", "estimate.py")


def _names(path: Path, packages: tuple[str, ...]) -> set[str]:
    return {m for m in imported_modules(path) if m.split(".")[0] in packages}


def test_no_simulation_benchmark_imports_the_service() -> None:
    found = {p.name: _names(p, ("api",)) for p in sorted((ROOT / "benchmarks").glob("*.py"))}
    assert {"search_efficiency.py", "family.py", "plan_calibration.py"} <= set(found)
    assert {name: names for name, names in found.items() if names and name not in SERVICE_BENCHMARKS} == {}
    # The exception stays as narrow as it is: a service benchmark that stops needing api/ leaves it.
    assert {name for name, names in found.items() if names} == SERVICE_BENCHMARKS


def test_the_store_and_the_rehearsal_import_neither_the_service_nor_the_worker() -> None:
    for name in SHARED:
        assert _names(ROOT / "optimizer" / name, ("api", "workers", "benchmarks")) == set(), name


def test_the_walk_sees_an_import_inside_a_function(tmp_path: Path) -> None:
    bench = tmp_path / "bench.py"
    bench.write_text("import math\n\ndef f():\n    from api.rehearsal import drive\n    return drive\n")
    assert _names(bench, ("api",)) == {"api.rehearsal", "api.rehearsal.drive"}
