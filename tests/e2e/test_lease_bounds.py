"""Every lease has a bound the study cannot lift (issue 35, item 4), for real: the API process, a
worker process and the simulated engine on Postgres.

Seen on cc094f3: stopping a study did not release the host still benchmarking its baseline.  Now
a stopped study's lease ends at its next heartbeat: the worker stops the engine.  The bound at the
door and the heartbeat's answer in process: tests/api/test_lease_bounds.py.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.e2e.test_study_runs import MODELS, spec
from tests.support.cluster import alive, cluster
from tests.support.helpers import wait_for


@pytest.mark.slow
@pytest.mark.postgres
def test_stopping_a_study_while_it_benchmarks_releases_the_host_and_stops_the_engine(
    pg_db_url: str, tmp_path: Path
) -> None:
    # Open loop at 0.05 req/s: each pass of its baseline spreads 64 requests over ~21 minutes.
    slow = spec("slow-open", 2, workload={"output_len": 16, "num_prompts": 64, "concurrency": [1],
                                          "warmup_requests": 0, "repeats": 1, "request_rate": 0.05})  # fmt: skip
    with cluster(tmp_path, pg_db_url, lease_ttl_s=30) as c:
        c.create_study(slow)
        w = c.add_worker("gpu-a", MODELS)

        def benchmarking() -> set[int]:
            # The engine is up and the benchmark's arrivals are under way.
            return w.engine_pids() if "server ready" in w.log_text() else set()

        pids = wait_for("the baseline's benchmark", benchmarking, timeout=120, interval=0.5, context=w.log_text)
        [lease] = c.leases("slow-open")
        assert (lease["kind"], lease["state"]) == ("baseline", "active"), lease
        r = httpx.post(f"{c.api_url}/v1/studies/slow-open/stop", headers=c.user, timeout=30)
        assert r.status_code == 200, r.text

        wait_for("the worker to drop the lease", lambda: "has ended" in w.log_text(), timeout=60, context=w.log_text)
        wait_for("the engine to be gone", lambda: not any(alive(p) for p in pids), timeout=60, context=w.log_text)
        [lease] = c.leases("slow-open")
        fleet = c.fleet()

    assert lease["state"] == "superseded", lease
    assert fleet["gpu-a"]["state"] == "ok", fleet["gpu-a"]  # stopping a study is no fault of the host
    assert fleet["gpu-a"]["current_lease"] is None, fleet["gpu-a"]
