"""The API stores a baseline's verify probe with the baseline and returns it (issue 31 item 2).

Both backends: a worker's baseline report with `verify_probe` is kept in the baseline's stored
metrics and shown with that host's baseline in `GET /v1/studies/{name}`; a report without one (an
older worker) is accepted and shows none.
"""

from __future__ import annotations

from typing import Any

from tests.support.api_client import Api
from tests.support.specs import INVENTORY, small_spec

PROBE = {
    "points": [
        {"concurrency": 1, "tokens": 1, "seconds": 0.0111, "seconds_runs": [0.0111, 0.0112, 0.0110]},
        {"concurrency": 1, "tokens": 32, "seconds": 0.0142, "seconds_runs": [0.0141, 0.0142, 0.0144]},
    ],
    "prefix_tokens": 256,
    "cached_share": 1.0,
    "spent_s": 4.25,
    "note": None,
}


def _baseline(api: Api, worker: str, **metrics: Any) -> None:
    r = api.post(f"/v1/workers/{worker}/lease", "worker", INVENTORY)
    assert r.status_code == 200, r.text
    lease = r.json()
    assert lease["kind"] == "baseline", lease
    level = {"concurrency": 1, "output_tok_s": 90.0, "output_tok_s_runs": [89.0, 90.0, 91.0]}
    body = {"outcome": "ok", "metrics": {"levels": [level], "startup_s": 3.0, **metrics}}
    r = api.post(f"/v1/leases/{lease['lease_id']}/complete", "worker", body)
    assert r.status_code == 200 and r.json()["state"] == "completed", r.text


def test_the_probe_is_stored_with_the_baseline_and_returned_an_older_report_shows_none(api: Api) -> None:
    assert api.post("/v1/studies", "user", small_spec("probe")).status_code == 201
    _baseline(api, "w1", verify_probe=PROBE)
    _baseline(api, "w2")  # a worker from before the probe
    shown = api.get("/v1/studies/probe", "user").json()
    by_host = {b["worker_id"]: b for b in shown["baselines"]}
    assert by_host["w1"]["verify_probe"] == PROBE
    assert by_host["w2"]["verify_probe"] is None
    assert by_host["w1"]["tok_s"] == {"1": 90.0}


def test_a_probe_out_of_bounds_is_refused_with_the_report(api: Api) -> None:
    assert api.post("/v1/studies", "user", small_spec("probe-bad")).status_code == 201
    lease = api.post("/v1/workers/w1/lease", "worker", INVENTORY).json()
    bad = {**PROBE, "points": [{**PROBE["points"][0], "seconds": -0.5}]}
    level = {"concurrency": 1, "output_tok_s": 90.0}
    body = {"outcome": "ok", "metrics": {"levels": [level], "verify_probe": bad}}
    r = api.post(f"/v1/leases/{lease['lease_id']}/complete", "worker", body)
    assert r.status_code == 422, r.text
