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


def ask(api: Api, worker: str, inventory: dict[str, Any] = INVENTORY) -> Any:
    r = api.post(f"/v1/workers/{worker}/lease", "worker", inventory)
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


def _refuse_remote_code_study(api: Api, inventory: dict[str, Any] = INVENTORY) -> None:
    spec = small_spec("remote-code", model={**small_spec()["model"], "extra_args": {"--trust-remote-code": True}})
    assert api.post("/v1/studies", "user", spec).status_code == 201
    lease = ask(api, "w1", inventory)
    assert lease is not None and lease["study"] == "remote-code"
    assert api.post(f"/v1/leases/{lease['lease_id']}/complete", "worker", REFUSED).status_code == 200
    assert ask(api, "w1", inventory) is None


def test_a_refusal_ends_when_the_workers_config_digest_changes(api: Api) -> None:
    inv = {**INVENTORY, "config_digest": "a" * 16}
    assert api.post("/v1/workers/w1/lease", "worker", inv).status_code == 204  # registered with digest a
    _refuse_remote_code_study(api, inv)
    # The fleet view and the study agree on the standing refusal, and so does /metrics.
    (w1,) = api.get("/v1/workers", "user").json()
    assert [r["study"] for r in w1["refusals"]] == ["remote-code"] and w1["health"] == "ok"
    assert w1["sglang_version"] == "0.5.23" and w1["config_digest"] == "a" * 16
    shown = api.get("/v1/studies/remote-code", "user").json()
    assert shown["eligibility"]["eligible_workers"] == []
    metrics = api.get("/metrics", "user").text
    assert 'spectune_study_eligible_workers{study="remote-code"} 0.0' in metrics
    # Same digest: still refused.  Changed digest (the operator allowed the flag): offered again.
    assert api.post("/v1/workers/w1/lease", "worker", inv).status_code == 204
    r = api.post("/v1/workers/w1/lease", "worker", {**inv, "config_digest": "b" * 16})
    assert r.status_code == 200 and r.json()["study"] == "remote-code"
    shown = api.get("/v1/studies/remote-code", "user").json()
    assert shown["refused_by"] == [] and shown["eligibility"]["eligible_workers"] == ["w1"]
    assert 'spectune_study_eligible_workers{study="remote-code"} 1.0' in api.get("/metrics", "user").text


def test_an_admin_clears_a_workers_refusals(api: Api) -> None:
    _refuse_remote_code_study(api)
    assert api.post("/v1/workers/w1/refusals/clear", "user").status_code == 403
    assert api.post("/v1/workers/nope/refusals/clear", "admin").status_code == 404
    r = api.post("/v1/workers/w1/refusals/clear", "admin")
    assert r.status_code == 200 and r.json() == {"cleared": 1}
    assert api.get("/v1/workers", "user").json()[0]["refusals"] == []
    lease = ask(api, "w1")
    assert lease is not None and lease["study"] == "remote-code"
    assert api.post("/v1/workers/w1/refusals/clear", "admin").json() == {"cleared": 0}
