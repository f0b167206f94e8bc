"""A lease a worker refuses for what the study asks is a study fault, not a host fault (issue 13).

Seen: a study with `extra_args {"--trust-remote-code": true}`, refused (correctly) by a worker
whose config does not allow it: each refused baseline counted as a host failure, and the worker
was quarantined after 3 leases in under 0.2 s.
"""

from __future__ import annotations

from typing import Any

from tests.conftest import INVENTORY, Api, small_spec

REFUSED = {
    "outcome": "failed",
    "failure": {"kind": "refused", "message": "server flag(s) --trust-remote-code not on this worker's allowlist"},
}


def ask(api: Api, worker: str) -> Any:
    r = api.post(f"/v1/workers/{worker}/lease", "worker", INVENTORY)
    assert r.status_code in (200, 204), r.text
    return r.json() if r.status_code == 200 else None


def test_a_refused_study_counts_nothing_against_the_host_and_is_not_offered_again(api: Api) -> None:
    spec = small_spec("remote-code", model={**small_spec()["model"], "extra_args": {"--trust-remote-code": True}})
    assert api.post("/v1/studies", "user", spec).status_code == 201
    for _ in range(3):  # three refusals used to quarantine the host
        lease = ask(api, "w1")
        if lease is None:
            break
        r = api.post(f"/v1/leases/{lease['lease_id']}/complete", "worker", REFUSED)
        assert r.status_code == 200, r.text
    # Refused once, the study is not offered to w1 again; w1 is healthy and gets other studies.
    assert ask(api, "w1") is None
    workers = {w["id"]: w for w in api.get("/v1/workers", "user").json()}
    assert workers["w1"]["state"] == "ok"
    assert api.post("/v1/studies", "user", small_spec("plain")).status_code == 201
    other = ask(api, "w1")
    assert other is not None and other["study"] == "plain"
    # The study says who refused it and why; another worker may still run it.
    shown = api.get("/v1/studies/remote-code", "user").json()
    assert [r["worker_id"] for r in shown["refused_by"]] == ["w1"]
    assert "--trust-remote-code" in shown["refused_by"][0]["message"]
    assert ask(api, "w2")["study"] == "remote-code"


def test_a_refused_trial_is_retried_elsewhere_not_taught(api: Api) -> None:
    assert api.post("/v1/studies", "user", small_spec("prompts")).status_code == 201
    for w in ("w1", "w2"):
        base = ask(api, w)
        ok = {"outcome": "ok", "metrics": {"levels": [{"concurrency": 1, "output_tok_s": 100.0}]}}
        assert api.post(f"/v1/leases/{base['lease_id']}/complete", "worker", ok).status_code == 200
    trial = ask(api, "w1")
    refused = {"outcome": "failed", "failure": {"kind": "refused", "message": "prompt set 'x.jsonl': not found"}}
    assert api.post(f"/v1/leases/{trial['lease_id']}/complete", "worker", refused).status_code == 200
    retry = ask(api, "w2")
    assert retry["trial_number"] == trial["trial_number"] and retry["attempt"] == 2
    trials = {t["number"]: t for t in api.get("/v1/studies/prompts/trials", "user").json()}
    assert trials[trial["trial_number"]]["state"] == "RUNNING"  # not taught as infeasible
    workers = {w["id"]: w for w in api.get("/v1/workers", "user").json()}
    assert workers["w1"]["state"] == "ok"
