"""Study faults are never host faults, for real (issue 18, item 2): the API process, a worker
process and the simulated engine on Postgres.

Seen: `model.mem_fraction_static: 0.01` got a worker quarantined in ~6 s (three baseline OOMs),
and `extra_args: {"--dtype": "bogus"}` one whose SGLang has real `--dtype` choices in under 1 s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_study_runs import MODELS, spec
from tests.support.cluster import cluster
from tests.support.helpers import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


def test_studies_that_cannot_start_are_charged_to_themselves_and_the_host_works_on(
    pg_db_url: str, tmp_path: Path
) -> None:
    with cluster(tmp_path, pg_db_url) as c:
        c.create_study(spec("tiny-mem", 2, model={**spec("x", 1)["model"], "mem_fraction_static": 0.01}))
        c.create_study(spec("bogus-dtype", 2, model={**spec("x", 1)["model"], "extra_args": {"--dtype": "bogus"}}))
        c.create_study(spec("innocent", 2))
        c.add_worker("gpu-a", MODELS)

        def innocent_measured() -> dict[str, Any] | None:
            done = [t for t in c.trials("innocent") if t["state"] == "COMPLETE"]
            return done[0] if done else None

        wait_for("the innocent study's first trial", innocent_measured, timeout=180, interval=1.0)
        tiny, bogus, fleet = c.study("tiny-mem"), c.study("bogus-dtype"), c.fleet()
        leases = {name: c.leases(name) for name in ("tiny-mem", "bogus-dtype")}

    assert fleet["gpu-a"]["state"] == "ok", fleet["gpu-a"]
    # Each failed once, on its baseline, and was never handed out again.
    for name, got in leases.items():
        assert [(le["kind"], le["state"]) for le in got] == [("baseline", "failed")], (name, got)
    assert leases["tiny-mem"][0]["result"]["failure"]["kind"] == "oom"
    failure = leases["bogus-dtype"][0]["result"]["failure"]
    assert (failure["kind"], failure["host_fault"]) == ("invalid_config", False), failure
    # The study is told what is wrong: a rejected value or out of memory keeps it from this host
    # and says why; one host's word does not stop it (issue 35: it takes two tokens).
    assert bogus["state"] == "running" and bogus["finish_reason"] is None, bogus["finish_reason"]
    assert [r["worker_id"] for r in bogus["refused_by"]] == ["gpu-a"] and "--dtype" in bogus["refused_by"][0]["message"]
    assert tiny["state"] == "running"
    assert [r["worker_id"] for r in tiny["refused_by"]] == ["gpu-a"]
    assert "oom" in tiny["refused_by"][0]["message"] and "mem-fraction-static" in tiny["refused_by"][0]["message"]
