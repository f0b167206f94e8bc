"""A GPU host says in its own log what the fleet decided about it (issue 33 item 6): quarantined,
released, a study refused, each with the reason and the command that clears it.  A real API
process, real worker processes and the simulated engine on Postgres."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import pytest

from spectune_protocol import RefusedStudy, WorkerStanding
from tests.e2e.test_study_runs import MODELS, spec
from tests.support.cluster import cluster
from tests.support.helpers import wait_for
from workers.standing import changes

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def test_a_worker_logs_its_quarantine_release_and_refusals(pg_db_url: str, tmp_path: Path) -> None:
    # One host failure quarantines (the default is 3): the engine of gpu-bad crashes on every start.
    with cluster(tmp_path, pg_db_url, api_env={"SPECTUNE_QUARANTINE_AFTER": "1"}) as c:
        c.create_study(spec("tiny-mem", 2, model={**spec("x", 1)["model"], "mem_fraction_static": 0.01}))
        c.create_study(spec("plain", 8))
        good = c.add_worker("gpu-ok", MODELS)
        bad = c.add_worker("gpu-bad", MODELS, env={"SPECTUNE_SIM_FAULT": "crash_after:0.2"})

        wait_for("gpu-ok to log its refusal", lambda: "REFUSED it" in good.log_text(), timeout=180, interval=0.5)
        wait_for("gpu-bad to log its quarantine", lambda: "QUARANTINED" in bad.log_text(), timeout=180, interval=0.5)
        fleet = c.fleet()
        assert fleet["gpu-bad"]["state"] == "quarantined"
        admin = {"Authorization": f"Bearer {c.tokens['admin']}"}
        r = httpx.post(f"{c.api_url}/v1/workers/gpu-bad/release", headers=admin, timeout=30)
        assert r.status_code < 300, r.text
        wait_for("gpu-bad to log its release", lambda: "RELEASED" in bad.log_text(), timeout=120, interval=0.5)
        good_log, bad_log = good.log_text(), bad.log_text()

    refused = next(line for line in good_log.splitlines() if "REFUSED it" in line)
    # The study, the reason (its baseline ran out of memory at mem_fraction_static 0.01) and the command.
    assert "study tiny-mem is no longer offered" in refused and "oom" in refused, refused
    assert "spectune workers clear-refusals gpu-ok" in refused
    assert "WARNING" in refused and good_log.count("study tiny-mem is no longer offered") == 1
    quarantined = next(line for line in bad_log.splitlines() if "QUARANTINED" in line)
    # The fleet's reason (one line, cut at 255 characters), as `workers list` gives it.
    assert fleet["gpu-bad"]["quarantine_reason"][:200] in quarantined, (quarantined, fleet["gpu-bad"])
    assert "1 host failure in a row" in quarantined and "spectune workers release gpu-bad" in quarantined
    # Said once per change: the first quarantine, then the release, in that order.
    assert bad_log.index("QUARANTINED") < bad_log.index("RELEASED")
    assert "QUARANTINED" not in good_log  # a refusal is the study's fault, never the host's


def test_each_change_of_standing_is_one_line_with_what_clears_it() -> None:
    nothing = WorkerStanding()
    held = WorkerStanding(quarantined="3 host failures in a row; last: crash")
    refused = WorkerStanding(refused=[RefusedStudy(study="s1", reason="model m not in this worker's registry")])
    assert changes(nothing, nothing, "w1") == []
    [(level, text)] = changes(nothing, held, "w1")
    assert level == logging.ERROR and "QUARANTINED" in text and "3 host failures" in text
    assert "`spectune workers release w1`" in text
    assert changes(held, held, "w1") == []  # no repeat while it stands
    [(level, text)] = changes(held, nothing, "w1")
    assert level == logging.WARNING and "RELEASED" in text
    [(_, text)] = changes(nothing, refused, "w1")
    assert "study s1" in text and "not in this worker's registry" in text and "clear-refusals w1" in text
    [(_, text)] = changes(refused, nothing, "w1")
    assert "s1 is offered to this worker again" in text
