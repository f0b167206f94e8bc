"""tests/ mirrors the packages (issue 32 item 5): every test file sits in the folder of what it
tests, every folder stands for a first-party package (or one of three named exceptions), and the
helpers tests share live in tests/support/, the fixtures in tests/conftest.py.

A file the checks refuse says where it is and what to do: move it (`git mv`) to the folder of the
package it tests, and its helpers to tests/support/.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from tests.support.helpers import REPO

TESTS = REPO / "tests"

# Folder under tests/ -> the first-party package it tests.
PACKAGE_FOLDERS = {
    "optimizer": "optimizer",
    "api": "api",
    "workers": "workers",
    "sim": "spectune_sim",
    "spectune": "spectune",  # the `spectune` package itself: spectune/conformance/
    "benchmarks": "benchmarks",  # run from the checkout (`python -m benchmarks.chaos`), not shipped
}
# Folders that test no single package, and the files of the repository they test.
OTHER_FOLDERS = {
    # A real API process with real worker processes on the simulated engine: the packages together.
    "e2e": ("api", "workers", "spectune_sim"),
    # What a user installs and deploys from: the README's blocks as printed, the Makefile's install
    # targets, the Docker and systemd files.
    "deploy": ("README.md", "Makefile", "Dockerfile", "docker-compose.yml", "workers/systemd"),
    # The tests' own machinery: this layout, conftest.py's clean-up on SIGTERM.
    "support": ("tests/conftest.py", "tests/support"),
}


def first_party() -> set[str]:
    """The top-level packages pyproject.toml ships, and benchmarks/ (first-party, run in place)."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    shipped = {p.rstrip("*").split(".")[0] for p in config["tool"]["setuptools"]["packages"]["find"]["include"]}
    return shipped | {"benchmarks"}


def folders(tests: Path) -> list[Path]:
    return sorted(p for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__")


def python_files(tests: Path) -> list[Path]:
    return sorted(p for p in tests.rglob("*.py") if "__pycache__" not in p.parts)


def misplaced_tests(tests: Path) -> list[str]:
    """Test files not exactly one folder below `tests`."""
    return [
        str(p.relative_to(tests))
        for p in python_files(tests)
        if p.name.startswith("test_") and p.parent.parent != tests
    ]


def unknown_folders(tests: Path) -> list[str]:
    return [p.name for p in folders(tests) if p.name not in PACKAGE_FOLDERS and p.name not in OTHER_FOLDERS]


def helpers_outside_support(tests: Path) -> list[str]:
    """Modules that are neither a test file, a conftest.py nor an __init__.py, outside support/."""
    return [
        str(p.relative_to(tests))
        for p in python_files(tests)
        if not p.name.startswith("test_")
        and p.name not in ("conftest.py", "__init__.py")
        and p.parent != tests / "support"
    ]


def conftest_importers(tests: Path) -> list[str]:
    found = []
    for p in python_files(tests):
        for node in ast.walk(ast.parse(p.read_text(), filename=str(p))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            if any(n == "tests.conftest" or n.startswith("tests.conftest.") for n in names):
                found.append(str(p.relative_to(tests)))
    return found


def test_every_test_file_lives_in_a_folder_one_level_under_tests() -> None:
    misplaced = misplaced_tests(TESTS)
    assert not misplaced, (
        f"test files outside tests/<folder>/: {misplaced}; move each (`git mv`) to the folder of the "
        f"package it tests: {sorted(PACKAGE_FOLDERS)}, or {sorted(OTHER_FOLDERS)}"
    )


def test_every_folder_stands_for_a_first_party_package_or_a_named_exception() -> None:
    unknown = unknown_folders(TESTS)
    assert not unknown, f"tests/ folders that stand for no package: {unknown}"
    packages = first_party()
    not_ours = {f: pkg for f, pkg in PACKAGE_FOLDERS.items() if pkg not in packages}
    assert not not_ours, f"folders named for packages this repository does not have: {not_ours}"
    for folder, package in PACKAGE_FOLDERS.items():
        assert any((REPO / package).glob("*.py")), f"tests/{folder}/: the package {package}/ has no modules"
    for folder, paths in OTHER_FOLDERS.items():
        missing = [p for p in paths if not (REPO / p).exists()]
        assert not missing, f"tests/{folder}/ tests {missing}, which no longer exist"


def test_every_folder_is_a_package_so_two_folders_may_hold_one_file_name() -> None:
    """pytest's default import mode (prepend) names a test module by its package path: without
    `__init__.py`, a test_config.py in two folders would be one module, `test_config`."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "--import-mode" not in " ".join(config.get("addopts", [])), "the check below assumes prepend mode"
    assert (TESTS / "__init__.py").is_file()
    missing = [p.name for p in folders(TESTS) if not (p / "__init__.py").is_file()]
    assert not missing, f"folders without __init__.py: {missing}"


def test_helpers_live_in_support_and_fixtures_in_conftest() -> None:
    """Helpers live in tests/support/.  Tests take fixtures by name and never import conftest.py
    (a helper imported from it would be a second home for what tests/support/ holds)."""
    elsewhere = helpers_outside_support(TESTS)
    assert not elsewhere, f"helper modules outside tests/support/: {elsewhere}"
    importers = conftest_importers(TESTS)
    assert not importers, f"import from tests.support instead of tests.conftest in: {importers}"


def test_the_checks_see_a_tree_laid_out_wrong(tmp_path: Path) -> None:
    """Each check, on a tree with one of each mistake, names exactly that mistake (a check that
    sees nothing would pass whatever the layout)."""
    tests = tmp_path / "tests"
    for folder in ("api", "support", "misc"):
        (tests / folder).mkdir(parents=True)
        (tests / folder / "__init__.py").write_text("")
    (tests / "api" / "test_ok.py").write_text("from tests.support.specs import small_spec\n")
    (tests / "api" / "deeper").mkdir()
    (tests / "api" / "deeper" / "test_nested.py").write_text("")
    (tests / "test_flat.py").write_text("")
    (tests / "support" / "specs.py").write_text("")
    (tests / "api" / "api_helpers.py").write_text("")
    (tests / "misc" / "test_uses_conftest.py").write_text("def f():\n    from tests.conftest import Api\n")
    assert misplaced_tests(tests) == ["api/deeper/test_nested.py", "test_flat.py"]
    assert unknown_folders(tests) == ["misc"]
    assert helpers_outside_support(tests) == ["api/api_helpers.py"]
    assert conftest_importers(tests) == ["misc/test_uses_conftest.py"]
