"""Bad input gets the right 4xx with a message naming the problem, and stored data is unchanged."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.api_client import Api
from tests.support.specs import INVENTORY, small_spec


def snapshot(api: Api) -> Any:
    return api.get("/v1/studies", "user").json(), api.get("/v1/studies/keep", "user").json()["spec"]


@pytest.fixture
def seeded(api: Api) -> Api:
    assert api.post("/v1/studies", "user", small_spec("keep")).status_code == 201
    return api


@pytest.mark.parametrize(
    ("mutate", "field", "words"),
    [
        (lambda s: s.update(name="Bad Name!"), "name", "not a valid study name"),
        (lambda s: s["search_space"].update(topk=[]), "search_space.topk", "at least one"),
        (lambda s: s["search_space"].update(num_steps={"low": 5, "high": 2}), "search_space.num_steps", "low <= high"),
        (
            lambda s: s["search_space"].update(
                num_steps={"low": 1, "high": 3}, topk=[1, 2], num_draft_tokens={"low": 2, "high": 64}
            ),
            "search_space.num_draft_tokens",
            "at most 11 draft tokens (draft tokens - 1 <= topk + (steps - 1) * topk^2)",
        ),
        (
            lambda s: s.update(warm_start=[{"num_steps": 2, "topk": 2, "num_draft_tokens": 8}]),
            "warm_start.0.num_draft_tokens",
            "draft tokens - 1 <= topk + (steps - 1) * topk^2, so at most 7",
        ),
        (
            lambda s: s.update(warm_start=[{"num_steps": 5, "topk": 8, "num_draft_tokens": 3}]),
            "warm_start.0",
            "more steps than its draft tokens can use",
        ),
        (lambda s: s["model"].update(target="/etc/passwd"), "model.target", "never a filesystem path"),
        (lambda s: s["model"].update(extra_args={"--load-format": "dummy"}), "model.extra_args", "not allowed"),
        (
            lambda s: s["model"].update(attention_backend="magic"),
            "model.attention_backend",
            "unknown attention backend",
        ),
        (lambda s: s.update(sampler="cmaes"), "sampler", "'auto', 'tpe', 'gp', 'random', 'grid' or 'list'"),
        (lambda s: s.update(surprise=1), "surprise", "Extra inputs are not permitted"),
        (lambda s: s.update(placement={f"k{i}": "v" for i in range(65)}), "placement", "at most 64 items"),
        (lambda s: s.update(objective={"concurrency": 8}), "objective.concurrency", "not one of the workload's"),
        (lambda s: s["workload"].update(prompts="../../secret"), "workload.prompts", "no path"),
        (
            lambda s: s["model"].update(attention_backend="trtllm_mha"),
            "search_space.topk",
            "trtllm_mha attention backend allows only topk 1",
        ),
    ],
)
def test_bad_spec_is_422_naming_the_field(seeded: Api, mutate: Any, field: str, words: str) -> None:
    before = snapshot(seeded)
    spec = small_spec("new-study")
    mutate(spec)
    r = seeded.post("/v1/studies", "user", spec)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["field"] == field, err
    assert words in err["message"], err
    assert snapshot(seeded) == before


def test_garbage_json_is_422_with_a_message(seeded: Api) -> None:
    before = snapshot(seeded)
    r = seeded.client.post(
        "/v1/studies", content=b"{not json", headers={**seeded.h("user"), "Content-Type": "application/json"}
    )
    assert r.status_code == 422
    assert "not valid JSON" in r.json()["error"]["message"]
    assert snapshot(seeded) == before


def test_name_taken_is_409_and_the_first_study_is_untouched(seeded: Api) -> None:
    before = snapshot(seeded)
    other = small_spec("keep", budget={"max_trials": 99})
    r = seeded.post("/v1/studies", "user", other)
    assert r.status_code == 409
    assert "exists already" in r.json()["error"]["message"]
    assert snapshot(seeded) == before


def test_unknown_study_is_404(seeded: Api) -> None:
    for path in ("/v1/studies/nope", "/v1/studies/nope/trials"):
        r = seeded.get(path, "user")
        assert r.status_code == 404
        assert "no study named 'nope'" in r.json()["error"]["message"]
    assert seeded.post("/v1/studies/nope/stop", "user").status_code == 404


def test_auth_missing_wrong_role_and_revoked(seeded: Api, db_url: str) -> None:
    c = seeded.client
    r = c.get("/v1/studies")
    assert r.status_code == 401 and "missing bearer token" in r.json()["error"]["message"]
    assert c.get("/v1/studies", headers={"Authorization": "Bearer st_nope"}).status_code == 401
    # A worker token can only lease and report.
    before = snapshot(seeded)
    r = seeded.post("/v1/studies", "worker", small_spec("sneaky"))
    assert r.status_code == 403 and "needs the role" in r.json()["error"]["message"]
    assert seeded.get("/v1/studies", "worker").status_code == 403
    assert seeded.get("/v1/workers", "worker").status_code == 403
    # A user token cannot pretend to be a worker.
    assert seeded.post("/v1/workers/w1/lease", "user", INVENTORY).status_code == 403
    assert snapshot(seeded) == before

    from api.auth import create_token, revoke_token
    from api.db import make_engine, make_sessionmaker

    engine = make_engine(db_url)
    factory = make_sessionmaker(engine)
    tid, token = create_token(factory, "user")
    assert c.get("/v1/studies", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    revoke_token(factory, tid)
    r = c.get("/v1/studies", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]
    engine.dispose()


def test_bound_worker_token_cannot_act_as_another_worker(seeded: Api, db_url: str) -> None:
    from api.auth import create_token
    from api.db import make_engine, make_sessionmaker

    engine = make_engine(db_url)
    _, token = create_token(make_sessionmaker(engine), "worker", worker_id="w1")
    engine.dispose()
    h = {"Authorization": f"Bearer {token}"}
    other = seeded.client.post("/v1/workers/w2/lease", headers=h, json=INVENTORY)
    assert other.status_code == 403
    mine = seeded.client.post("/v1/workers/w1/lease", headers=h, json=INVENTORY)
    assert mine.status_code == 200
    # Another worker's token cannot report on w1's lease... unless unbound; a bound one cannot.
    _ = mine.json()["lease_id"]


def test_lease_protocol_errors(seeded: Api) -> None:
    missing = "00000000-0000-0000-0000-000000000000"
    assert seeded.post(f"/v1/leases/{missing}/heartbeat", "worker").status_code == 404
    assert seeded.post("/v1/leases/not-a-uuid/heartbeat", "worker").status_code == 422
    r = seeded.post("/v1/workers/w1/lease", "worker", {"sglang_version": "0.5.23", "gpus": "many"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "gpus"
    b = seeded.post("/v1/workers/w1/lease", "worker", INVENTORY).json()
    r = seeded.post(f"/v1/leases/{b['lease_id']}/complete", "worker", {"outcome": "ok"})
    assert r.status_code == 422 and r.json()["error"]["field"] == "metrics"
    r = seeded.post(
        f"/v1/leases/{b['lease_id']}/complete", "worker", {"outcome": "failed", "failure": {"kind": "meteor"}}
    )
    assert r.status_code == 422


def test_oversized_body_is_413(seeded: Api) -> None:
    big = small_spec("big")
    big["placement"] = {f"k{i}": "x" * 1000 for i in range(2000)}
    r = seeded.post("/v1/studies", "user", big)
    assert r.status_code == 413


def test_unknown_api_paths_answer_the_api_error_shape(api: Api) -> None:
    # Seen: POST /v1/leases//complete answered 403 "a worker token may not view the dashboard",
    # GET /v1/nope an HTML 404 (both fell through to the dashboard mounted at /).
    for method, path, role in (
        ("POST", "/v1/leases//complete", "worker"),
        ("GET", "/v1/nope", "user"),
        ("GET", "/v1", "user"),
        ("DELETE", "/v1/studies/s1/trials/3", "admin"),
        ("GET", "/v1/nope", None),
    ):
        headers = api.h(role) if role else {}
        r = api.client.request(method, path, headers=headers)
        assert r.status_code == 404, (method, path, r.status_code, r.text)
        body = r.json()
        assert body["error"]["code"] == "not_found" and path in body["error"]["message"]
    # A known path with another method: 405 naming the allowed ones.
    r = api.client.request("DELETE", "/v1/studies", headers=api.h("user"))
    assert r.status_code == 405, r.text
    assert "POST" in r.headers["allow"] and "GET" in r.headers["allow"]
    assert r.json()["error"]["code"] == "method_not_allowed"
    r = api.client.request("GET", "/v1/leases/00000000-0000-0000-0000-000000000000/complete", headers=api.h("worker"))
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.text


@pytest.mark.parametrize("body", [b"{not json", b"[" * 100_000])
def test_a_database_outage_while_checking_the_token_of_a_bad_body_is_a_503(api: Api, body: bytes) -> None:
    """The token of an unparsable body is checked in the error handler (api.errors): a database
    that cannot be reached there is the documented 503 with Retry-After, not a bare 500."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import sessionmaker

    ctx = api.client.app.state.ctx  # type: ignore[attr-defined]
    # A real database server that is down: nothing listens on port 1 of the loopback.
    down = create_engine("postgresql+psycopg://postgres@127.0.0.1:1/spectune", connect_args={"connect_timeout": 5})
    reads, ctx.sessions = ctx.sessions, sessionmaker(down)
    try:
        r = api.client.post("/v1/studies", content=body, headers={**api.h("user"), "Content-Type": "application/json"})
    finally:
        ctx.sessions = reads
        down.dispose()
    assert r.status_code == 503, r.text
    assert r.headers["Retry-After"] and r.json()["error"]["code"] == "storage_unavailable"
