"""A worker never relaunches a server in a loop, whatever the API does (issue 11).

Seen: a lease whose trial had been finished behind its back answered 409 on every progress call;
the worker abandoned the work, asked again, got the same lease back and relaunched the server,
115 times in 11 minutes.  The API no longer hands such a lease back (tests/api/test_lease_livelock.py,
tests/api/test_lease_states.py); these tests make sure the worker would not loop even if it did.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from spectune_protocol import LevelMetrics
from tests.support.helpers import wait_for
from tests.workers.test_agent import (  # noqa: F401 - `api` is a fixture
    api,
    lease_body,
    needs_simulator,
    running_agent,
    write_config,
)
from workers.ledger import LaunchLedger


@needs_simulator
def test_a_lost_lease_handed_back_is_refused_and_reported_never_relaunched(tmp_path, api, caplog):  # noqa: F811
    caplog.set_level(logging.INFO)
    fake, server = api
    body = lease_body("L-1")
    body["workload"]["num_prompts"] = 200  # still running when the 409 arrives
    fake.queue = [body]
    fake.heartbeat_status["L-1"] = 409
    fake.hand_back_forever = True  # the broken API of the livelock
    with running_agent(write_config(tmp_path, server.url)) as (agent, _):
        wait_for("the worker to refuse the lease three times", lambda: agent.leases_refused >= 3, 120)
    launches = caplog.text.count("lease L-1: launching the server")
    assert launches == 1, caplog.text[-3000:]
    refusals = [b for e, lid, b in fake.calls if e == "complete" and lid == "L-1"]
    assert refusals, "the refusal was never reported"
    assert refusals[0]["failure"]["kind"] == "lost" and "refused by the worker" in refusals[0]["failure"]["message"]


def test_the_ledger_caps_starts_per_lease_across_restarts(tmp_path: Path) -> None:
    ledger = LaunchLedger(tmp_path, max_starts=2)
    assert ledger.refusal("L-1") is None
    ledger.started("L-1")
    # A worker killed mid-work restarts and gets its live lease back: one more start is allowed.
    restarted = LaunchLedger(tmp_path, max_starts=2)
    assert restarted.refusal("L-1") is None
    restarted.started("L-1")
    again = LaunchLedger(tmp_path, max_starts=2)
    refusal = again.refusal("L-1")
    assert refusal is not None and "2 times" in refusal
    # Work that ended (reported or abandoned) is never started again, even once.
    again.ended("L-2")
    assert "already ended" in (LaunchLedger(tmp_path).refusal("L-2") or "")
    assert LaunchLedger(tmp_path).refusal("L-3") is None


def test_an_unreadable_ledger_does_not_stop_the_worker(tmp_path: Path) -> None:
    (tmp_path / "lease-starts.ledger").write_text("{not json")
    ledger = LaunchLedger(tmp_path)
    assert ledger.refusal("L-1") is None
    ledger.started("L-1")
    assert LaunchLedger(tmp_path).refusal("L-1") is None  # rewritten, one start counted


@needs_simulator
def test_shutdown_mid_benchmark_reports_the_levels_already_measured(tmp_path, api):  # noqa: F811
    fake, server = api
    body = lease_body("L-1")
    body["workload"]["concurrency"] = [1, 2]
    body["workload"]["num_prompts"] = 4
    fake.queue = [body]
    fake.progress_gate = gate = threading.Event()
    # Level 1 is measured and its progress call is held; the shutdown comes meanwhile.
    with running_agent(write_config(tmp_path, server.url)) as (agent, _):
        wait_for("the first level", lambda: "L-1" in fake.names("progress"), 120)
        agent.request_stop("test shutdown")
        gate.set()
        wait_for("the report", lambda: "L-1" in fake.completed, 60)
    report = fake.reports()["L-1"]
    assert report.outcome == "failed", "a partial workload must not pose as a finished trial"
    assert report.failure is not None and report.failure.kind == "lost"
    assert [lv.concurrency for lv in report.failure.levels][:1] == [1]
    assert all(isinstance(lv, LevelMetrics) and lv.output_tok_s > 0 for lv in report.failure.levels)
