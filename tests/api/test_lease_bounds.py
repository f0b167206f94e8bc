"""Every lease has a bound the study cannot lift (issue 35, item 4).

Seen on cc094f3: `workload.request_rate: 1e-6` was accepted; a worker took the baseline and was
still "benchmarking" minutes later, its heartbeats extending the lease; stopping the study did not
release the host.  Now a workload whose level could hold a host past `MAX_LEVEL_S` is refused at
the door, and a stopped study's lease ends at its next heartbeat: the worker stops the engine (with
real processes: tests/e2e/test_lease_bounds.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from optimizer.spec import MAX_LEVEL_S, StudySpec, level_seconds
from tests.support.api_client import Api
from tests.support.helpers import ok_result
from tests.support.specs import INVENTORY, small_spec

PROGRESS = {"step": 0, "concurrency": 1, "output_tok_s": 5.0}


@pytest.mark.parametrize(
    ("workload", "field", "says"),
    [
        # The reproduction: one request every 11.6 days.
        ({"request_rate": 1e-6}, "workload.request_rate", "raise request_rate to at least"),
        ({"request_rate": 0.001, "num_prompts": 100}, "workload.request_rate", "or lower num_prompts or repeats"),
        # Closed loop: 100,000 requests of 32k tokens one at a time.
        ({"num_prompts": 100_000, "output_len": 32768}, "workload", "lower num_prompts"),
    ],
)
def test_a_workload_that_would_hold_a_host_past_the_bound_is_refused_at_the_door(
    api: Api, workload: dict[str, Any], field: str, says: str
) -> None:
    r = api.post("/v1/studies", "user", small_spec("slow", workload=workload))
    assert r.status_code == 422, r.text
    body = r.json()
    assert body["error"]["field"] == field, body
    assert f"{MAX_LEVEL_S:,.0f} s" in body["detail"] and says in body["detail"], body["detail"]
    assert api.get("/v1/studies/slow", "user").status_code == 404


def test_the_bound_is_the_one_stated_and_ordinary_workloads_pass(api: Api) -> None:
    # Just inside: the arrivals take exactly the maximum.
    inside = {"request_rate": 3 * 64 / MAX_LEVEL_S, "num_prompts": 64, "repeats": 3}
    arrivals, _ = level_seconds(StudySpec.model_validate(small_spec("x", workload=inside)).workload, 1)
    assert arrivals == pytest.approx(MAX_LEVEL_S)
    r = api.post("/v1/studies", "user", small_spec("inside", workload=inside))
    assert r.status_code == 201, r.text
    outside = {**inside, "request_rate": inside["request_rate"] * 0.99}
    r = api.post("/v1/studies", "user", small_spec("outside", workload=outside))
    assert r.status_code == 422, r.text


def test_a_stopped_studys_trial_lease_ends_at_its_heartbeat_and_a_resume_measures_it_again(api: Api) -> None:
    assert api.post("/v1/studies", "user", small_spec("paused")).status_code == 201
    base = api.post("/v1/workers/w1/lease", "worker", INVENTORY).json()
    assert api.post(f"/v1/leases/{base['lease_id']}/complete", "worker", ok_result()).status_code == 200
    trial = api.post("/v1/workers/w1/lease", "worker", INVENTORY).json()
    assert trial["kind"] == "trial"
    assert api.post(f"/v1/leases/{trial['lease_id']}/heartbeat", "worker").status_code == 200
    assert api.post("/v1/studies/paused/stop", "user").status_code == 200

    r = api.post(f"/v1/leases/{trial['lease_id']}/heartbeat", "worker")
    assert r.status_code == 409 and "stopped" in r.text, r.text  # the worker stops the engine
    assert api.post(f"/v1/leases/{trial['lease_id']}/progress", "worker", PROGRESS).status_code == 409
    assert api.post("/v1/workers/w1/lease", "worker", INVENTORY).status_code == 204  # the host is free

    assert api.post("/v1/studies/paused/resume", "user").status_code == 200
    again = api.post("/v1/workers/w1/lease", "worker", INVENTORY).json()
    assert again["kind"] == "trial" and again["trial_number"] == trial["trial_number"], again
    assert again["lease_id"] != trial["lease_id"]
