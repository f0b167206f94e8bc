"""`spectune study create|list|show|watch|best` against a real API server process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from tests.api.test_report import report_spec, run_simulated_study

pytestmark = pytest.mark.slow


def cli(base: str, token: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SPECTUNE_API_URL": base, "SPECTUNE_TOKEN": token, "TZ": "UTC"}
    env.pop("SPECTUNE_DATABASE_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "api.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )  # fmt: skip


def test_study_commands_end_to_end(server: tuple[str, dict[str, str]], tmp_path: Path) -> None:
    base, tokens = server
    user = tokens["user"]
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(report_spec("from-cli", max_trials=3, concurrency=(1,))))
    r = cli(base, user, "study", "create", "-f", str(spec_file))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "created study from-cli (running)"
    # Creating it again is a one-line error, exit 2.
    r = cli(base, user, "study", "create", "-f", str(spec_file))
    assert r.returncode == 2 and r.stderr.startswith("error: 409") and "Traceback" not in r.stderr

    # Nothing measured yet: `best` says so, `watch` gives up after its timeout with exit 1.
    r = cli(base, user, "study", "best", "from-cli")
    assert r.returncode == 4 and r.stderr.startswith("# no answer: nothing measured yet") and r.stdout == ""
    r = cli(base, user, "study", "watch", "from-cli", "--timeout", "0", "--interval", "0.2")
    assert r.returncode == 1 and "still running" in r.stderr
    assert "running  [" in r.stdout and "0/3 launched" in r.stdout

    # A whole simulated study through the lease API, then every view of it.
    with httpx.Client(base_url=base, timeout=30) as client:
        shown = run_simulated_study(client, tokens, report_spec("done", max_trials=6, concurrency=(1, 4)))

    r = cli(base, user, "study", "list")
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and lines[0].split() == ["study", "state", "model", "complete", "running", "failed"]
    assert any(line.split()[:2] == ["done", "finished"] for line in lines)
    # (the simulated worker served the CLI's study too: it takes work from every running study)
    assert any(line.split()[:1] == ["from-cli"] for line in lines)

    r = cli(base, user, "study", "show", "done")
    assert r.returncode == 0, r.stderr
    assert shown["verdict"] in r.stdout and shown["deployment"]["launch_command"].splitlines()[-1] in r.stdout
    header = next(line for line in r.stdout.splitlines() if line.startswith("#"))
    assert header.split()[:6] == ["#", "state", "steps/topk/tok", "speedup", "tok/s@1", "AL"]
    assert "oom" in r.stdout  # the failed configuration is in the table
    # The trials table holds what the search measured: the search's best trial is `best_measured`.
    measured = shown["best_measured"]
    best_row = next(line for line in r.stdout.splitlines() if line.split()[:1] == [str(measured["trial_number"])])
    assert f"{measured['speedup']:.3f}" in best_row
    raw = json.loads(cli(base, user, "study", "show", "done", "--json").stdout)
    assert raw["best"]["trial_number"] == shown["best"]["trial_number"]

    # The command, unless the measurement was no answer (a saturated host): then none anywhere.
    command = "" if shown["outcome"] == "no_answer" else shown["deployment"]["launch_command"]
    r = cli(base, user, "study", "watch", "done", "--timeout", "30")
    assert r.returncode == 0 and "finished" in r.stdout and command in r.stdout

    # The exit status names the outcome: 0 pays, 3 does not pay, 5 cannot tell apart, 4 no answer.
    r = cli(base, user, "study", "best", "done", "--format", "sglang")
    assert r.returncode == {"pays": 0, "does_not_pay": 3, "cannot_tell_apart": 5, "no_answer": 4}[shown["outcome"]]
    assert r.stdout.strip() == command
    assert "python -m sglang.launch_server " in r.stdout or not command
    best = json.loads(cli(base, user, "study", "best", "done", "--format", "json").stdout)
    assert best["winner"]["config"] == shown["winner"]["config"] and best["state"] == "finished"
    assert set(best["winner"]["speedup_interval_by_level"]) == {"1", "4"}
    r = cli(base, user, "study", "best", "done", "--format", "yaml")
    assert r.returncode == 2 and "unknown --format 'yaml'" in r.stderr

    # Errors are one line, exit 2: unknown study, a worker token.
    r = cli(base, user, "study", "show", "nope")
    assert r.returncode == 2 and r.stderr.startswith("error: 404") and len(r.stderr.strip().splitlines()) == 1
    r = cli(base, tokens["worker"], "study", "list")
    assert r.returncode == 2 and r.stderr.startswith("error: 403")


def test_token_create_writes_a_private_file(tmp_path: Path, sqlite_template: Path) -> None:
    db = tmp_path / "t.db"
    shutil.copy(sqlite_template, db)
    out = tmp_path / "worker.token"
    r = subprocess.run(
        [sys.executable, "-m", "api.cli", "token", "create", "--role", "worker", "--worker-id", "sim-1",
         "--output", str(out), "--database-url", f"sqlite:///{db}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    token = out.read_text().strip()
    assert token.startswith("st_") and token not in r.stdout  # the token goes to the file only
    assert (out.stat().st_mode & 0o777) == 0o600
