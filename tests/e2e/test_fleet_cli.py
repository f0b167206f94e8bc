"""Operating the fleet from the CLI, end to end: real API, real worker processes, simulated engine.

A worker refuses a study whose flag is outside its allowlist; the operator sees it in `spectune
workers list`, allows the flag and restarts the worker: its config digest changed, so its
refusal ends and the study runs on it, with no command to clear anything.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.cluster import cluster, kill_engines, start_worker
from tests.support.helpers import stop_process_group, wait_for
from tests.support.specs import small_spec

pytestmark = pytest.mark.slow

MODELS = {"moe-pcie": "moe-pcie", "moe-pcie-eagle3": "moe-pcie-eagle3"}


def spectune(api_url: str, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPECTUNE_API_URL": api_url, "SPECTUNE_TOKEN": token, "TZ": "UTC"}
    env.pop("SPECTUNE_DATABASE_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "api.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_a_refused_study_is_offered_again_after_the_workers_allowlist_changes(
    tmp_path: Path, sqlite_template: Path
) -> None:
    db = tmp_path / "spectune.db"
    shutil.copy(sqlite_template, db)
    (tmp_path / "run").mkdir()
    with cluster(tmp_path / "run", f"sqlite:///{db}") as c:
        remote = {**small_spec()["model"], "extra_args": {"--trust-remote-code": True}}
        c.create_study(small_spec("remote-code", model=remote, budget={"max_trials": 1}, confirmation={"top": 0}))
        w = c.add_worker("sim-1", MODELS)
        refused = wait_for("the refusal", lambda: c.study("remote-code")["refused_by"], timeout=120)
        assert refused[0]["worker_id"] == "sim-1" and "--trust-remote-code" in refused[0]["message"]
        assert "allowed_extra_args" in refused[0]["message"]  # the message says what to change

        listed = spectune(c.api_url, c.tokens["user"], "workers", "list")
        assert listed.returncode == 0, listed.stderr
        header, row = listed.stdout.splitlines()[:2]
        assert header.split()[:3] == ["worker", "health", "last"] and row.split()[:2] == ["sim-1", "ok"]
        assert (
            "0.5.23" in row and "sim-1: refused study remote-code: server flag(s) --trust-remote-code" in listed.stdout
        )

        # The operator opts this host into --trust-remote-code and restarts the worker.
        assert w.proc is not None
        stop_process_group(w.proc, timeout=30)
        kill_engines(w)
        text = w.config.read_text()
        w.config.write_text(text.replace("[engine]\n", '[engine]\nallowed_extra_args = ["--trust-remote-code"]\n'))
        start_worker(w)

        done = wait_for(
            "the study to run on sim-1", lambda: (s := c.study("remote-code"))["state"] == "finished" and s, 240
        )
        assert done["best"] is not None and done["best"]["worker_id"] == "sim-1", w.log_text()[-3000:]
        assert done["refused_by"] == []
        listed = spectune(c.api_url, c.tokens["user"], "workers", "list", "--json")
        assert listed.returncode == 0 and '"refusals": []' in listed.stdout

        # release and clear-refusals are an admin's; a user's token gets the API's one-line 403.
        r = spectune(c.api_url, c.tokens["user"], "workers", "release", "sim-1")
        assert r.returncode == 2 and r.stderr.startswith("error: 403") and "Traceback" not in r.stderr
        r = spectune(c.api_url, c.tokens["admin"], "workers", "release", "sim-1")
        assert r.returncode == 0 and "released" in r.stdout, r.stderr
        r = spectune(c.api_url, c.tokens["admin"], "workers", "clear-refusals", "sim-1")
        assert r.returncode == 0 and r.stdout.strip() == "sim-1: 0 refusal(s) cleared", r.stderr
        r = spectune(c.api_url, c.tokens["admin"], "workers", "clear-refusals", "no-such-worker")
        assert r.returncode == 2 and "404" in r.stderr
