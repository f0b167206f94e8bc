"""The chaos run, CI-sized: killed workers and a killed API process lose nothing.

Two API processes on one Postgres database, four workers driving the simulated engine, a
twelve-trial study; three workers are SIGKILLed at random moments and restarted, one API process
is SIGKILLed and restarted.  Postgres is *not* restarted here: CI runs other tests against the
same server at the same time (the full run, `python -m benchmarks.chaos`, restarts it).
`benchmarks/chaos.py` holds the machinery and the checks; see its docstring.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.chaos import ChaosPlan, run_chaos

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def test_killed_workers_and_a_killed_api_lose_nothing(pg_db_url: str, tmp_path: Path) -> None:
    plan = ChaosPlan(
        workers=4,
        trials=12,
        worker_kills=3,
        kill_api=True,
        restart_postgres=False,
        seed=3,
        time_limit_s=600.0,  # a hang guard: the study ends much sooner on an idle machine
    )
    report = run_chaos(plan, tmp_path, pg_db_url)
    print("\n".join(report.lines()))
    assert report.problems == [], "\n".join(report.lines() + report.log.events)
    f = report.figures
    assert report.log.worker_kills == 3 and report.log.api_kills == 1, report.log.events
    trials = f["trials"]
    assert set(trials) <= {"COMPLETE", "PRUNED", "FAIL"} and trials.get("COMPLETE", 0) >= 1, trials
    assert f["reports queued by workers"] > 12 and f["  lost"] == 0
    assert f["orphaned engines"] == 0 and f["token values in logs"] == 0
