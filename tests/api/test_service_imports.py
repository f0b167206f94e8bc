"""The service modules import each other one way: no cycle among api/services/'s modules, a
subpackage (leasing/) counting as one unit, function-level imports included (tests/support/source_walk.py).

A cycle hides which part decides what: study_life and the lease package importing each other was
one (the lease row builder and the refusals now live in modules both import)."""

from __future__ import annotations

from pathlib import Path

from tests.support.source_walk import import_cycle

ROOT = Path(__file__).resolve().parents[2]


def test_the_service_modules_import_each_other_without_a_cycle() -> None:
    assert import_cycle(ROOT, "api.services") is None


def test_the_walk_would_see_a_cycle_through_a_subpackage(tmp_path: Path) -> None:
    services = tmp_path / "api" / "services"
    (services / "pkg").mkdir(parents=True)
    (services / "__init__.py").write_text("")
    (services / "pkg" / "__init__.py").write_text("")
    (services / "life.py").write_text("from api.services.pkg.rows import build\n")
    (services / "pkg" / "rows.py").write_text("def build(): ...\n")
    (services / "pkg" / "service.py").write_text("from api.services import life\n")
    (services / "other.py").write_text("def f():\n    from api.services.life import x\n")
    assert import_cycle(tmp_path, "api.services") == ["api.services.life", "api.services.pkg", "api.services.life"]
    # One way only (life -> pkg, other -> life): no cycle.
    (services / "pkg" / "service.py").write_text("from api.services.pkg import rows\n")
    assert import_cycle(tmp_path, "api.services") is None
    # A function-level import closes one as well.
    (services / "pkg" / "rows.py").write_text("def build():\n    import api.services.other\n")
    assert import_cycle(tmp_path, "api.services") == [
        "api.services.life",
        "api.services.pkg",
        "api.services.other",
        "api.services.life",
    ]
