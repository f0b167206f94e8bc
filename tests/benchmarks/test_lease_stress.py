"""Leasing under CPU contention: a study runs to its end with nothing looping and nothing lost.

Four workers drive the simulated engine against the API while busy loops hold every core (two per
core), on the embedded default (SQLite, one API process) and on Postgres (two API processes).
The machinery and the checks are benchmarks/chaos.py's (here with no faults injected):
* every trial ends exactly once, none still RUNNING, each FAIL with a kind and a message, no
  trial measured by two leases;
* no 5xx answered and no traceback in any API log;
* no lease launched twice (worker logs);
* on database snapshots taken during the run: no worker and no trial with two active leases, and
  no lease left active on a finished trial (the state machine's invariants,
  api/services/leasing/states.py);
* every report a worker queued is stored; no engine outlives its worker.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from benchmarks.chaos import ChaosPlan, run_chaos

pytestmark = pytest.mark.slow

PLAN = ChaosPlan(
    workers=4,
    trials=6,
    worker_kills=0,
    kill_api=False,
    restart_postgres=False,
    seed=11,
    lease_ttl_s=30.0,
    time_limit_s=600.0,
    busy_loops=2 * (os.cpu_count() or 1),
    confirm_top=1,
)


def _assert_clean(report) -> None:  # type: ignore[no-untyped-def]
    print("\n".join(report.lines()))
    assert report.problems == [], "\n".join(report.lines() + report.log.events)
    f = report.figures
    assert report.log.finished and report.log.snapshots >= 3
    assert f["trials"].get("COMPLETE", 0) >= 1, f["trials"]
    assert f["  lost"] == 0 and f["orphaned engines"] == 0
    assert f["5xx answered by the API"] == {}


def test_sqlite_study_under_contention_runs_to_its_end(sqlite_template: Path, tmp_path: Path) -> None:
    db = tmp_path / "spectune.db"
    shutil.copy(sqlite_template, db)
    _assert_clean(run_chaos(PLAN.__class__(**{**PLAN.__dict__, "apis": 1}), tmp_path / "run", f"sqlite:///{db}"))


@pytest.mark.postgres
def test_postgres_study_with_two_api_processes_under_contention(pg_db_url: str, tmp_path: Path) -> None:
    _assert_clean(run_chaos(PLAN, tmp_path / "run", pg_db_url))
