"""A study is stopped for its own fault only on two tokens' word, or the spec's own proof, and a
benchmark the engine refuses for the spec is the study's fault (issue 35 items 2 and 3).

Seen on cc094f3: one forged `invalid_config` on a baseline lease stopped another user's study at
once, the attacker's text in its finish_reason and dashboard note (Markdown links rendered); a
spec with `context_length: 128` and `input_len: 4096` had the engine answer HTTP 400, reported as
a `benchmark_error` charged to the host: three baselines quarantined the host, the study ran on.
"""

from __future__ import annotations

from typing import Any

from api.documents import StudyDocument
from api.notes import render_note
from tests.api.test_plausibility import Liar
from tests.support.api_client import Api
from tests.support.specs import INVENTORY, small_spec
from workers.loadgen.errors import EngineRejected, LoadgenError
from workers.loadgen.rejection import rejected_field

LINK = "[fix it here](https://evil.example/x)"
FORGED = {
    "outcome": "failed",
    "failure": {"kind": "invalid_config", "message": f"argument --dtype: invalid choice \x1b[2J {LINK}"},
}


def fleet_lease(api: Api, worker: str) -> dict[str, Any]:
    r = api.post(f"/v1/workers/{worker}/lease", "fleet", INVENTORY)
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_one_tokens_forged_invalid_config_stops_no_study(api: Api) -> None:
    assert api.post("/v1/studies", "user", small_spec("victim")).status_code == 201
    liar = Liar(api)
    for worker in ("liar-1", "liar-2"):  # one token, two worker ids: one witness
        lease = liar.ask(worker)
        assert lease is not None and lease["kind"] == "baseline"
        liar.report(lease, FORGED)
        assert api.get("/v1/studies/victim", "user").json()["state"] == "running"
    # A host with a token of its own agrees: now the fault follows the study.
    lease = fleet_lease(api, "gpu-a")
    assert api.post(f"/v1/leases/{lease['lease_id']}/complete", "fleet", FORGED).status_code == 200
    shown = api.get("/v1/studies/victim", "user").json()
    assert shown["state"] == "stopped"
    reason = shown["finish_reason"]
    # The classified reason first; the worker's text after it, escaped, as plain text.
    assert reason.startswith(
        "stopped: its baseline failed (on 2 hosts with their own worker tokens): the engine rejected"
    )
    assert "\x1b" not in reason and "\\x1b" in reason
    note = render_note(StudyDocument.model_validate(shown), [])
    assert LINK not in note and "\\[fix it here\\]\\(https://evil\\.example/x\\)" in note


def test_a_context_the_workload_does_not_fit_stops_the_study_at_once_and_spares_the_hosts(api: Api) -> None:
    spec = small_spec("long-prompts")
    spec["model"] = {**spec["model"], "context_length": 128}
    spec["workload"] = {**spec["workload"], "input_len": 4096}
    assert api.post("/v1/studies", "user", spec).status_code == 201
    lease = fleet_lease(api, "gpu-a")
    assert lease["kind"] == "baseline"
    rejected = {
        "outcome": "failed",
        "failure": {
            "kind": "request_rejected",
            "spec_field": "workload.input_len",
            "message": "workload.input_len: HTTP 400: The input (4096 tokens) is longer than the model's context length",
        },
    }
    assert api.post(f"/v1/leases/{lease['lease_id']}/complete", "fleet", rejected).status_code == 200
    shown = api.get("/v1/studies/long-prompts", "user").json()
    assert shown["state"] == "stopped"
    assert "workload.input_len 4096 + workload.output_len 32 exceed model.context_length 128" in shown["finish_reason"]
    (host,) = api.get("/v1/workers", "user").json()
    assert host["state"] == "ok"


def test_a_rejected_request_the_spec_does_not_prove_needs_two_tokens_and_never_charges_a_host(api: Api) -> None:
    assert api.post("/v1/studies", "user", small_spec("odd-params")).status_code == 201
    rejected = {
        "outcome": "failed",
        "failure": {"kind": "request_rejected", "spec_field": "workload", "message": "workload: HTTP 400: bad params"},
    }
    for n, worker in enumerate(("gpu-a", "gpu-b"), start=1):
        lease = fleet_lease(api, worker)
        assert api.post(f"/v1/leases/{lease['lease_id']}/complete", "fleet", rejected).status_code == 200
        state = api.get("/v1/studies/odd-params", "user").json()["state"]
        assert state == ("running" if n == 1 else "stopped")
    assert {w["state"] for w in api.get("/v1/workers", "user").json()} == {"ok"}


def test_the_worker_names_the_spec_field_an_engines_4xx_points_at() -> None:
    too_long = "The input (4096 tokens) is longer than the model's context length (128 tokens)."
    assert rejected_field(EngineRejected("x", 400, too_long)) == "workload.input_len"
    assert rejected_field(EngineRejected("x", 400, "max_new_tokens must be positive")) == "workload.output_len"
    assert rejected_field(EngineRejected("x", 422, "something else")) == "workload"
    # A shard's error arrives as text: the status is read back from the load generator's words.
    assert rejected_field(LoadgenError(f"request 3: HTTP 400 from http://127.0.0.1:1/generate: {too_long}")) == (
        "workload.input_len"
    )
    for not_the_spec in ("request 3: HTTP 500 from http://x/generate: boom", "request 3: HTTP 429 from u: busy",
                         "request 3: HTTP time-out (ReadTimeout) after 3 of 48 tokens"):  # fmt: skip
        assert rejected_field(LoadgenError(not_the_spec)) is None
