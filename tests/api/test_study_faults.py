"""A lease a worker refuses for what the study asks is a study fault, not a host fault (issue 13).

Seen: a study with `extra_args {"--trust-remote-code": true}`, refused (correctly) by a worker
whose config does not allow it: each refused baseline counted as a host failure, and the worker
was quarantined after 3 leases in under 0.2 s.
"""

from __future__ import annotations

from typing import Any

from tests.support.api_client import Api
from tests.support.helpers import ok_result
from tests.support.specs import INVENTORY, small_spec

REFUSED = {
    "outcome": "failed",
    "failure": {"kind": "refused", "message": "server flag(s) --trust-remote-code not on this worker's allowlist"},
}


def ask(api: Api, worker: str, inventory: dict[str, Any] = INVENTORY) -> Any:
    r = api.post(f"/v1/workers/{worker}/lease", "fleet", inventory)
    assert r.status_code in (200, 204), r.text
    return r.json() if r.status_code == 200 else None


def test_a_refused_study_counts_nothing_against_the_host_and_is_not_offered_again(api: Api) -> None:
    spec = small_spec("remote-code", model={**small_spec()["model"], "extra_args": {"--trust-remote-code": True}})
    assert api.post("/v1/studies", "user", spec).status_code == 201
    for _ in range(3):  # three refusals used to quarantine the host
        lease = ask(api, "w1")
        if lease is None:
            break
        r = api.post(f"/v1/leases/{lease['lease_id']}/complete", "fleet", REFUSED)
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
        assert api.post(f"/v1/leases/{base['lease_id']}/complete", "fleet", ok_result()).status_code == 200
    trial = ask(api, "w1")
    refused = {"outcome": "failed", "failure": {"kind": "refused", "message": "prompt set 'x.jsonl': not found"}}
    assert api.post(f"/v1/leases/{trial['lease_id']}/complete", "fleet", refused).status_code == 200
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
    assert api.post(f"/v1/leases/{lease['lease_id']}/complete", "fleet", REFUSED).status_code == 200
    assert ask(api, "w1", inventory) is None


def test_a_refusal_ends_when_the_workers_config_digest_changes(api: Api) -> None:
    inv = {**INVENTORY, "config_digest": "a" * 16}
    assert api.post("/v1/workers/w1/lease", "fleet", inv).status_code == 204  # registered with digest a
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
    assert api.post("/v1/workers/w1/lease", "fleet", inv).status_code == 204
    r = api.post("/v1/workers/w1/lease", "fleet", {**inv, "config_digest": "b" * 16})
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


# ------------------------------------------------------------------- issue 18: baselines the study breaks

OOM = {"outcome": "failed", "failure": {"kind": "oom", "message": "CUDA out of memory: tried to allocate 2.0 GiB"}}
BOGUS_DTYPE = {
    "outcome": "failed",
    "failure": {
        "kind": "invalid_config",
        "message": "SGLang rejected the value the study gave --dtype (exit code 2): launch_server.py: error: "
        "argument --dtype: invalid choice: 'bogus'",
    },
}


def _workers(api: Api) -> dict[str, Any]:
    return {w["id"]: w for w in api.get("/v1/workers", "user").json()}


def test_a_baseline_the_study_cannot_fit_is_charged_to_the_study_not_the_host(api: Api) -> None:
    """`mem_fraction_static: 0.01`: three baseline OOMs quarantined a worker in ~6 s, and the same
    baseline was handed out again after each."""
    spec = small_spec("tiny-mem", model={**small_spec()["model"], "mem_fraction_static": 0.01})
    assert api.post("/v1/studies", "user", spec).status_code == 201
    first = ask(api, "w1")
    assert (first["study"], first["kind"]) == ("tiny-mem", "baseline")
    assert api.post(f"/v1/leases/{first['lease_id']}/complete", "fleet", OOM).status_code == 200
    # Not handed out again to that host, and nothing counted against it.
    assert ask(api, "w1") is None
    assert _workers(api)["w1"]["state"] == "ok"
    shown = api.get("/v1/studies/tiny-mem", "user").json()
    assert shown["state"] == "running"
    assert [r["worker_id"] for r in shown["refused_by"]] == ["w1"]
    assert "out of memory" in shown["refused_by"][0]["message"]
    # On a second host the fault follows the study: it is stopped, saying why.
    second = ask(api, "w2")
    assert second["study"] == "tiny-mem"
    assert api.post(f"/v1/leases/{second['lease_id']}/complete", "fleet", OOM).status_code == 200
    shown = api.get("/v1/studies/tiny-mem", "user").json()
    assert shown["state"] == "stopped" and "oom" in shown["finish_reason"], shown["finish_reason"]
    assert {w["state"] for w in _workers(api).values()} == {"ok"}
    # Other studies are untouched: both hosts take the next one.
    assert api.post("/v1/studies", "user", small_spec("innocent")).status_code == 201
    assert ask(api, "w1")["study"] == "innocent"
    assert ask(api, "w2")["study"] == "innocent"


def test_a_value_the_engine_rejects_stops_the_study_once_two_tokens_agree(api: Api) -> None:
    """`extra_args: {"--dtype": "bogus"}` got a worker quarantined in under 1 s.  One host's word
    no longer stops a study (issue 35: a forged one stopped other users' studies); two do."""
    spec = small_spec("bogus", model={**small_spec()["model"], "extra_args": {"--dtype": "bogus"}})
    assert api.post("/v1/studies", "user", spec).status_code == 201
    for n, worker in enumerate(("w1", "w2"), start=1):
        base = api.post(f"/v1/workers/{worker}/lease", "fleet", INVENTORY).json()
        assert api.post(f"/v1/leases/{base['lease_id']}/complete", "fleet", BOGUS_DTYPE).status_code == 200
        shown = api.get("/v1/studies/bogus", "user").json()
        assert shown["state"] == ("running" if n == 1 else "stopped")
    assert "--dtype" in shown["finish_reason"] and "engine rejected its settings" in shown["finish_reason"]
    assert {w["state"] for w in _workers(api).values()} == {"ok"}
    assert _workers(api)["w1"]["state"] == "ok"
    assert ask(api, "w2") is None  # stopped: no other host launches it either
    assert api.post("/v1/studies", "user", small_spec("next")).status_code == 201
    assert ask(api, "w1")["study"] == "next"


def test_broken_studies_in_a_row_do_not_make_a_host_look_sick(api: Api) -> None:
    """Two studies that cannot start, one after the other, on one host: each is charged to itself."""
    for name in ("tiny", "tinier"):
        spec = small_spec(name, model={**small_spec()["model"], "mem_fraction_static": 0.01})
        assert api.post("/v1/studies", "user", spec).status_code == 201
    for name in ("tiny", "tinier"):
        got = ask(api, "w1")
        assert got["study"] == name
        assert api.post(f"/v1/leases/{got['lease_id']}/complete", "fleet", OOM).status_code == 200
    assert ask(api, "w1") is None
    assert _workers(api)["w1"]["state"] == "ok"
    assert api.post("/v1/studies", "user", small_spec("innocent")).status_code == 201
    assert ask(api, "w1")["study"] == "innocent"


def test_a_fault_that_follows_the_host_still_counts_against_it(api: Api) -> None:
    """The same baseline ran on another host: out of memory here is this host's (another process
    holds its GPU), and it is quarantined as before."""
    assert api.post("/v1/studies", "user", small_spec("a")).status_code == 201
    elsewhere = ask(api, "w2")
    assert api.post(f"/v1/leases/{elsewhere['lease_id']}/complete", "fleet", ok_result()).status_code == 200
    failures = 0
    while (got := ask(api, "w1")) is not None and failures < 10:
        assert api.post(f"/v1/leases/{got['lease_id']}/complete", "fleet", OOM).status_code == 200
        failures += 1
    assert _workers(api)["w1"]["state"] == "quarantined"
    assert failures == 3  # SPECTUNE_QUARANTINE_AFTER
    shown = api.get("/v1/studies/a", "user").json()
    assert shown["state"] == "running" and shown["refused_by"] == []
    assert _workers(api)["w2"]["state"] == "ok"


def test_argparse_rejecting_a_study_flag_is_the_studys_fault() -> None:
    from workers.launcher import classify_exit

    invalid = "launch_server.py: error: argument --dtype: invalid choice: 'bogus' (choose from 'auto', 'half')\n"
    kind, host_fault, message = classify_exit(2, invalid, study_flags={"--dtype"})
    assert (kind, host_fault) == ("invalid_config", False)
    assert "model.extra_args" in message
    # The same rejection of a flag the worker set itself (its version's names) is the host's.
    assert classify_exit(2, invalid)[:2] == ("invalid_config", True)
    bad_int = "launch_server.py: error: argument --chunked-prefill-size: invalid int value: 'x'\n"
    assert classify_exit(2, bad_int, study_flags={"--chunked-prefill-size"})[:2] == ("invalid_config", False)
    unknown = "launch_server.py: error: unrecognized arguments: --moe-runner-backend triton\n"
    kind, host_fault, message = classify_exit(2, unknown, study_flags={"--moe-runner-backend"})
    assert (kind, host_fault) == ("refused", False) and "--moe-runner-backend" in message
    worker_flag = "launch_server.py: error: unrecognized arguments: --cuda-graph-max-bs-decode 8\n"
    assert classify_exit(2, worker_flag, study_flags={"--dtype"})[:2] == ("invalid_config", True)


def test_resuming_a_finished_study_says_why_it_finished_and_how_to_search_further() -> None:
    from api.services.study_life import finished_resume_message

    text = finished_resume_message("s", "converged", "converged: no configuration left is likely to beat 3/1/4")
    assert text.startswith("study 's' converged (converged: no configuration left")
    assert "budget.min_gain lower, or budget.converge: false" in text and "its budget is used" not in text
    assert "budget.max_trials higher" in finished_resume_message("s", "max_trials", "max_trials=8")
    # A rule this version does not know still gets a plain answer.
    assert finished_resume_message("s", "later", None).startswith("study 's' is finished; a finished study")
