"""workers/worker.sim.example.toml works when copied: its own header's commands, then a study runs on it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cluster import WorkerProc, cluster, start_worker
from tests.support.helpers import free_port, wait_for
from tests.support.specs import small_spec

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "workers" / "worker.sim.example.toml"


def header_commands() -> list[str]:
    """The `#   command` lines of the file's header, in order."""
    return [m.group(1) for m in re.finditer(r"^#   (\S.*?)(?:[ \t]+#.*)?$", EXAMPLE.read_text(), re.M)]


def test_the_simulated_worker_example_runs_a_study_as_copied(tmp_path: Path, sqlite_template: Path) -> None:
    commands = header_commands()
    assert commands[-1] == "spectune worker --config worker.toml"
    # A checkout-like folder holding the example, as the header's `cp` expects.
    (tmp_path / "workers").mkdir()
    shutil.copy(EXAMPLE, tmp_path / "workers" / EXAMPLE.name)
    db = tmp_path / "spectune.db"
    shutil.copy(sqlite_template, db)
    db_url = f"sqlite:///{db}"
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "SPECTUNE_DATABASE_URL": db_url,
    }
    # Every step but the last (the worker itself, started below), in one shell as a user would.
    subprocess.run(["bash", "-e", "-c", "\n".join(commands[:-1])], cwd=tmp_path, env=env, check=True, timeout=600)
    sim = tmp_path / "sim"
    assert (sim / "worker.token").stat().st_mode & 0o077 == 0

    (tmp_path / "run").mkdir()
    with cluster(tmp_path / "run", db_url) as c:
        # The one edit the header asks for when the API is not on 127.0.0.1:8000 (and a free engine port).
        cfg = sim / "worker.toml"
        text = cfg.read_text()
        text = text.replace('api_url = "http://127.0.0.1:8000"', f'api_url = "{c.api_url}"')
        text = text.replace("port = 30000", f"port = {free_port()}")
        cfg.write_text(text)
        w = WorkerProc("sim-1", cfg, sim / "worker.log", sim / "outbox")
        c.workers.append(w)
        start_worker(w)
        spec = small_spec("copied", budget={"max_trials": 1}, confirmation={"top": 0})
        c.create_study(spec)
        shown = wait_for("the study to finish", lambda: (s := c.study("copied"))["state"] == "finished" and s, 240)
        assert shown["best"] is not None and shown["best"]["worker_id"] == "sim-1", w.log_text()[-3000:]
        trials = c.trials("copied")
        done = [t for t in trials if t["state"] == "COMPLETE"]
        assert len(done) == 1 and done[0]["levels"][0]["output_tok_s"] > 0
