"""A GPU host's install: only the worker's dependencies, and `spectune worker` runs a study from it.

The package is built as a wheel from this tree and installed into a fresh virtualenv with the
`sim` extra (the simulated engine stands in for SGLang; it adds uvicorn and starlette only).  Run
from outside the tree, the worker's import closure must hold none of the API's packages.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_worker_sim_example import EXAMPLE
from tests.support.cluster import WorkerProc, cluster, kill_engines
from tests.support.helpers import build_dist, copy_checkout, free_port, stop_process_group, wait_for
from tests.support.specs import small_spec

pytestmark = pytest.mark.slow

# What a GPU host must not get (distribution names as pip lists them, and module names).
FORBIDDEN_DISTS = {"fastapi", "optuna", "optuna-dashboard", "matplotlib", "psycopg", "sqlalchemy", "typer", "torch"}
FORBIDDEN_MODULES = {"api", "fastapi", "optuna", "optuna_dashboard", "matplotlib", "psycopg", "sqlalchemy", "typer"}
WORKER_MODULES = (
    "workers.cli",
    "workers.agent",
    "workers.main",
    "workers.doctor.run",
    "workers.launcher.launcher",
    "workers.loadgen.shard_process",
    "spectune_sim.server",
    "spectune.cli",
    "spectune_protocol",
)


@pytest.fixture(scope="module")
def worker_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The documented way (the unit's header, README "Workers on GPU hosts"): the wheel `make dist`
    # builds from a checkout, into a fresh venv, with the simulated engine's extra for SGLang's.
    root = tmp_path_factory.mktemp("worker-install")
    wheel = build_dist(copy_checkout(root / "checkout"))
    venv = root / "venv"
    # The time-outs bound a hung step; they are not a speed budget (a busy CI machine took over
    # 120 s to make the venv, ensurepip included).
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=600)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", f"{wheel}[sim]"], check=True, timeout=600, cwd=root
    )  # fmt: skip
    return venv


def test_worker_install_holds_no_server_dependencies(worker_venv: Path, tmp_path: Path) -> None:
    listed = subprocess.run(
        [str(worker_venv / "bin" / "pip"), "list", "--format", "json"], capture_output=True, text=True, check=True
    )
    names = {d["name"].lower().replace("_", "-") for d in json.loads(listed.stdout)}
    assert "spectune" in names and not names & FORBIDDEN_DISTS, sorted(names & FORBIDDEN_DISTS)

    # The import closure of everything a worker runs, from outside the source tree.
    code = (
        "import importlib, json, sys\n"
        f"for m in {list(WORKER_MODULES)!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run(
        [str(worker_venv / "bin" / "python"), "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert r.returncode == 0, r.stderr
    loaded = set(json.loads(r.stdout))
    assert not loaded & FORBIDDEN_MODULES, sorted(loaded & FORBIDDEN_MODULES)

    bin_dir = worker_venv / "bin"
    r = subprocess.run([str(bin_dir / "spectune"), "worker", "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and "--config" in r.stdout
    r = subprocess.run([str(bin_dir / "spectune"), "doctor", "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and "--launch" in r.stdout
    r = subprocess.run([str(bin_dir / "spectune-worker"), "--version"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("spectune ")
    r = subprocess.run([str(bin_dir / "spectune"), "study", "list"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 2 and "worker-only installation" in r.stderr and "[server]" in r.stderr
    assert "spectune[" not in r.stderr  # never the unpublished name
    # `spectune --help` (and bare `spectune`) show what this install runs, and succeed.
    for argv in (["--help"], []):
        r = subprocess.run([str(bin_dir / "spectune"), *argv], capture_output=True, text=True, cwd=tmp_path)
        assert r.returncode == 0 and "worker --config FILE" in r.stdout and "worker-only" in r.stdout, r.stderr


def test_worker_from_the_worker_only_install_runs_a_study(
    worker_venv: Path, tmp_path: Path, sqlite_template: Path
) -> None:
    db = tmp_path / "spectune.db"
    shutil.copy(sqlite_template, db)
    db_url = f"sqlite:///{db}"
    sim = tmp_path / "sim"
    for name in ("moe-pcie", "moe-pcie-eagle3"):
        (sim / "models" / name).mkdir(parents=True)
    # The token is made where the database is (the API host); the GPU host only gets the file.
    subprocess.run(
        [sys.executable, "-m", "api.cli", "token", "create", "--role", "worker", "--worker-id", "sim-1",
         "--database-url", db_url, "--output", str(sim / "worker.token")],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    (tmp_path / "run").mkdir()
    with cluster(tmp_path / "run", db_url) as c:
        text = EXAMPLE.read_text().replace('api_url = "http://127.0.0.1:8000"', f'api_url = "{c.api_url}"')
        (sim / "worker.toml").write_text(text.replace("port = 30000", f"port = {free_port()}"))
        w = WorkerProc("sim-1", sim / "worker.toml", sim / "worker.log", sim / "outbox")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"TZ": "UTC"}
        with open(w.log, "ab") as log:
            w.proc = subprocess.Popen(
                [str(worker_venv / "bin" / "spectune"), "worker", "--config", "worker.toml"],
                cwd=sim, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip
        try:
            c.create_study(small_spec("from-worker-install", budget={"max_trials": 1}, confirmation={"top": 0}))
            shown = wait_for(
                "the study to finish", lambda: (s := c.study("from-worker-install"))["state"] == "finished" and s, 240
            )
            assert shown["best"] is not None and shown["best"]["worker_id"] == "sim-1", w.log_text()[-3000:]
        finally:
            stop_process_group(w.proc, timeout=30)
            kill_engines(w)
    # The engine ran with the worker-only venv's interpreter (the worker's own, by default).
    assert f"launching {worker_venv}/bin/python" in w.log_text()
