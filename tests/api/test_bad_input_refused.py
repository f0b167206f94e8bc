"""Regression tests for issue 13 ("What was seen"): bad input is refused at the door, never a 500.

Each test names the observation it holds.  Spec and report checks run on both backends through
the app; sessions and worker scope too.  The stateful fuzz test (tests/api/test_fuzz_stateful.py)
covers the same ground with generated input against a real server on Postgres.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.test_fuzz_stateful import BAD_COOKIES
from tests.api.test_rest_flow import lease, ok_metrics
from tests.support.api_client import Api, make_settings, make_tokens
from tests.support.specs import INVENTORY, set_path, small_spec


def _error(r: Any) -> dict[str, Any]:
    body = r.json()
    assert set(body) == {"error", "detail"}, body  # the documented shape
    assert body["detail"] == body["error"]["message"]
    err: dict[str, Any] = body["error"]
    return err


def _post_raw(api: Api, path: str, role: str, text: str) -> Any:
    # json.dumps writes NaN / Infinity as JSON's non-standard words, as a careless client would.
    return api.client.post(path, content=text, headers={**api.h(role), "Content-Type": "application/json"})


# ------------------------------------------------------------------- accepted now, 500 later


@pytest.mark.parametrize(
    ("dotted", "value", "field"),
    [
        ("seed", -5, "seed"),
        ("seed", 2**32, "seed"),
        ("budget.max_hours", 1e300, "budget.max_hours"),
        ("budget.max_hours", float("inf"), "budget.max_hours"),
        ("budget.patience", 10**30, "budget.patience"),
        ("objective.max_p99_itl_ms", float("inf"), "objective.max_p99_itl_ms"),
        ("objective.max_p99_ttft_ms", float("nan"), "objective.max_p99_ttft_ms"),
        ("model.extra_args", {"--schedule-conservativeness": float("nan")}, "model.extra_args"),
        ("model.extra_args", {"--schedule-conservativeness": float("inf")}, "model.extra_args"),
        ("model.extra_args", {"--chunked-prefill-size": 10**40}, "model.extra_args"),
        ("model.mem_fraction_static", float("nan"), "model.mem_fraction_static"),
        ("workload.concurrency", list(range(1, 4097)), "workload.concurrency"),
        ("workload.concurrency", list(range(1, 66)), "workload.concurrency"),
        ("search_space.num_draft_tokens", {"low": 2, "high": 10**30}, "search_space.num_draft_tokens.high"),
    ],
)
def test_spec_numbers_the_code_cannot_use_are_422_and_nothing_is_stored(
    api: Api, dotted: str, value: Any, field: str
) -> None:
    spec = set_path(small_spec("bad-number"), dotted, value)
    r = _post_raw(api, "/v1/studies", "user", json.dumps(spec))
    assert r.status_code == 422, r.text
    assert _error(r)["field"] == field
    assert api.get("/v1/studies", "user").json() == []


def test_a_large_seed_still_hands_out_trials(api: Api) -> None:
    """seed 5000 was accepted, then every trial lease answered 500 (seed * 1,000,003 > 2**32-1)."""
    for seed in (5000, 2**32 - 1):
        name = f"seed-{seed}"
        assert api.post("/v1/studies", "user", small_spec(name, seed=seed)).status_code == 201
        worker = f"w-{seed}"
        base = lease(api, worker).json()
        assert base["kind"] == "baseline" and base["study"] == name
        assert api.post(f"/v1/leases/{base['lease_id']}/complete", "worker", ok_metrics(90.0)).status_code == 200
        r = lease(api, worker)
        assert r.status_code == 200 and r.json()["kind"] == "trial", r.text
        done = api.post(f"/v1/leases/{r.json()['lease_id']}/complete", "worker", ok_metrics(100.0))
        assert done.status_code == 200, done.text
        api.post(f"/v1/studies/{name}/stop", "user")


def test_the_longest_budget_still_leases_and_other_studies_get_work(api: Api) -> None:
    """max_hours 1e300 made every lease of the fleet answer 500 after the baseline."""
    spec = small_spec("long", budget={"max_trials": 8, "max_hours": 100_000})
    assert api.post("/v1/studies", "user", spec).status_code == 201
    base = lease(api).json()
    assert api.post(f"/v1/leases/{base['lease_id']}/complete", "worker", ok_metrics(90.0)).status_code == 200
    r = lease(api)
    assert r.status_code == 200 and r.json()["kind"] == "trial", r.text


# ------------------------------------------------------------------- measurements without sense


@pytest.fixture
def baseline_lease(api: Api) -> tuple[Api, str]:
    spec = small_spec("measure", workload={**small_spec()["workload"], "concurrency": [1, 4]})
    assert api.post("/v1/studies", "user", spec).status_code == 201
    return api, lease(api).json()["lease_id"]


def _levels(*levels: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"outcome": "ok", "metrics": {"levels": list(levels), **extra}}


def _lv(concurrency: int, tok_s: Any, **extra: Any) -> dict[str, Any]:
    return {"concurrency": concurrency, "output_tok_s": tok_s, **extra}


def _deep(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {}
    for _ in range(depth):
        node = {"x": node}
    return node


@pytest.mark.parametrize(
    ("report", "field"),
    [
        (_levels(_lv(1, 1e309), _lv(4, 100.0)), "metrics.levels.0.output_tok_s"),
        (_levels(_lv(1, float("nan")), _lv(4, 100.0)), "metrics.levels.0.output_tok_s"),
        (_levels(_lv(1, 0.0), _lv(4, 100.0)), "metrics.levels.0.output_tok_s"),
        (_levels(_lv(1, 90.0, output_tok_s_runs=[float("nan"), float("inf")]), _lv(4, 100.0)), "metrics.levels.0"),
        (_levels(_lv(1, 90.0, itl_ms_p99=float("inf")), _lv(4, 100.0)), "metrics.levels.0.itl_ms_p99"),
        (_levels(_lv(1, 90.0, completion_tokens=10**30), _lv(4, 100.0)), "metrics.levels.0.completion_tokens"),
        (_levels(_lv(1, 90.0), _lv(4, 100.0), effective=_deep(300)), "metrics.effective"),
        (_levels(_lv(1, 90.0), _lv(4, 100.0), effective={"a": [1.0, float("nan")]}), "metrics.effective"),
        (_levels(_lv(1, 90.0), _lv(4, 100.0), startup_s=float("inf")), "metrics.startup_s"),
        (_levels(_lv(1, 90.0), _lv(1, 100.0)), "metrics.levels"),
        (_levels(_lv(1, 90.0), _lv(8, 100.0)), "metrics.levels"),
        (_levels(_lv(1, 90.0)), "metrics.levels"),  # a baseline measures every level
    ],
)
def test_reports_without_sense_are_422_and_the_lease_stays_open(
    baseline_lease: tuple[Api, str], report: dict[str, Any], field: str
) -> None:
    api, lease_id = baseline_lease
    r = _post_raw(api, f"/v1/leases/{lease_id}/complete", "worker", json.dumps(report))
    assert r.status_code == 422, r.text
    assert _error(r)["field"].startswith(field), r.text
    # Nothing was stored: the lease is still live and takes a sound report.
    assert api.post(f"/v1/leases/{lease_id}/heartbeat", "worker").status_code == 200
    good = _levels(_lv(1, 90.0), _lv(4, 300.0))
    assert api.post(f"/v1/leases/{lease_id}/complete", "worker", good).json()["state"] == "completed"


def test_progress_and_a_partial_trial_after_a_tiny_baseline_never_divide_by_zero(
    baseline_lease: tuple[Api, str],
) -> None:
    """After a baseline of output_tok_s 0, a partial complete answered 500 (ZeroDivisionError)."""
    api, lease_id = baseline_lease
    zero = _levels(_lv(1, 0.0), _lv(4, 0.0))
    assert api.post(f"/v1/leases/{lease_id}/complete", "worker", zero).status_code == 422
    smallest = _levels(_lv(1, 1e-3), _lv(4, 1e-3))
    # So slow a baseline is no measurement for a lease this short: quarantined, never stored (issue
    # 35); a baseline as slow as the bound allows takes its place.
    r = api.post(f"/v1/leases/{lease_id}/complete", "worker", smallest)
    assert r.status_code == 200 and r.json()["state"] == "failed"
    again = lease(api).json()
    assert again["kind"] == "baseline"
    slowest = _levels(_lv(1, 1.0), _lv(4, 1.0))
    assert api.post(f"/v1/leases/{again['lease_id']}/complete", "worker", slowest).status_code == 200
    trial = lease(api).json()
    assert trial["kind"] == "trial"
    p = api.post(
        f"/v1/leases/{trial['lease_id']}/progress", "worker", {"step": 0, "concurrency": 1, "output_tok_s": 1e9}
    )
    assert p.status_code == 200, p.text
    partial = api.post(f"/v1/leases/{trial['lease_id']}/complete", "worker", _levels(_lv(1, 1e9)))
    assert partial.status_code == 200, partial.text
    show = api.get("/v1/studies/measure", "user")
    assert show.status_code == 200
    assert api.get("/v1/studies/measure/trials", "user").status_code == 200


def test_a_spec_with_more_levels_than_a_report_may_carry_is_refused() -> None:
    from optimizer.spec import MAX_CONCURRENCY_LEVELS, parse_spec
    from spectune_protocol import Metrics

    limit = Metrics.model_fields["levels"].metadata
    assert any(getattr(m, "max_length", None) == MAX_CONCURRENCY_LEVELS for m in limit)
    ok = small_spec("max-levels", workload={"concurrency": list(range(1, MAX_CONCURRENCY_LEVELS + 1))})
    assert len(parse_spec(ok).workload.concurrency) == MAX_CONCURRENCY_LEVELS


# ------------------------------------------------------------------- names


@pytest.mark.parametrize(
    ("dotted", "value", "field"),
    [
        ("name", "abc\n", "name"),
        ("model.target", "moe-pcie\n", "model.target"),
        ("model.draft", "moe-pcie-eagle3\n", "model.draft"),
        ("workload.prompts", "prompts.jsonl\n", "workload.prompts"),
        ("workload.prompts", "builtin:chat\n", "workload.prompts"),
        ("model.extra_args", {"--dtype": "bfloat16\n"}, "model.extra_args"),
    ],
)
def test_names_with_a_trailing_newline_are_refused(api: Api, dotted: str, value: Any, field: str) -> None:
    r = api.post("/v1/studies", "user", set_path(small_spec("newline"), dotted, value))
    assert r.status_code == 422, r.text
    assert _error(r)["field"] == field
    assert api.get("/v1/studies", "user").json() == []


def test_a_worker_id_with_a_trailing_newline_is_refused(api: Api) -> None:
    r = api.post("/v1/workers/w1%0A/lease", "worker", INVENTORY)
    assert r.status_code == 422 and _error(r)["field"] == "path.worker_id", r.text
    assert api.get("/v1/workers", "user").json() == []


# ------------------------------------------------------------------- anonymous 500s


@pytest.mark.parametrize("cookie", BAD_COOKIES + [b"A" * 43 + b"." + b"0" * 64])  # the last: well formed, wrong MAC
def test_malformed_session_cookies_are_401_not_500(api: Api, cookie: bytes) -> None:
    r = api.client.get("/api/studies", headers={"Cookie": b"spectune_session=" + cookie})  # type: ignore[dict-item]
    assert r.status_code == 401, r.text
    assert _error(r)["code"] == "unauthorized"


def test_static_files_are_served_without_accept_encoding(api: Api) -> None:
    """optuna-dashboard read Accept-Encoding without a default: 500 KeyError."""
    for path in ("/favicon.ico", "/static/bundle.js"):
        # httpx adds Accept-Encoding by default; remove it, as a plain client or a proxy would.
        request = api.client.build_request("GET", path, headers=api.h("user"))
        del request.headers["accept-encoding"]
        r = api.client.send(request)
        assert r.status_code == 200, (path, r.status_code, r.text[:200])
        assert r.content


def test_deeply_nested_json_gets_the_documented_error_shape(api: Api) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    for headers in ({}, api.h("user")):
        r = api.client.post("/v1/studies", content=deep, headers={**headers, "Content-Type": "application/json"})
        assert r.status_code in (401, 422), r.text[:200]
        err = _error(r)
        if r.status_code == 422:
            assert err["code"] == "invalid" and err["field"] == "body"
    assert api.get("/v1/studies", "user").json() == []


def test_an_unexpected_exception_is_the_documented_500_and_counted(db_url: str, tmp_path: Path) -> None:
    from api.app import create_app

    app = create_app(make_settings(db_url, artifact_dir=str(tmp_path / "artifacts")))

    @app.get("/v1/boom", include_in_schema=False)
    def boom() -> None:
        raise RuntimeError("secret detail /srv/models/x")

    # Before the dashboard's catch-all mount at "/".
    app.router.routes.insert(0, app.router.routes.pop())

    tokens = make_tokens(db_url)
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/v1/boom")
        assert r.status_code == 500
        err = _error(r)
        assert err["code"] == "internal" and "secret detail" not in r.text and "Traceback" not in r.text
        metrics = client.get("/metrics", headers={"Authorization": f"Bearer {tokens['user']}"}).text
        line = next(x for x in metrics.splitlines() if x.startswith("spectune_http_unhandled_errors_total{"))
        assert 'route="/v1/boom"' in line and 'exception="RuntimeError"' in line and line.endswith(" 1.0")


# ------------------------------------------------------------------- sessions


def _login(api: Api, role: str = "user") -> str:
    from api.dashboard import SESSION_COOKIE

    api.client.cookies.clear()
    r = api.client.post("/login", data={"token": api.tokens[role]}, follow_redirects=False)
    assert r.status_code == 303, r.text
    return str(api.client.cookies[SESSION_COOKIE])


def test_after_logout_the_same_cookie_never_works_again(api: Api) -> None:
    from api.dashboard import SESSION_COOKIE

    cookie = _login(api)
    assert api.client.get("/api/studies").status_code == 200
    assert api.client.post("/logout", follow_redirects=False).status_code == 303
    # A copy of the cookie kept elsewhere (another tab, a thief) is dead too.
    api.client.cookies.clear()
    api.client.cookies.set(SESSION_COOKIE, cookie)
    r = api.client.get("/api/studies")
    assert r.status_code == 401 and "ended" in _error(r)["message"]


def test_a_database_reader_cannot_mint_or_revive_a_session(api: Api, db_url: str) -> None:
    """The MAC was keyed by the token's stored hash: a database copy could mint sessions."""
    import hashlib
    import hmac
    import time

    from sqlalchemy import create_engine, text

    from api.dashboard import SESSION_COOKIE

    cookie = _login(api)
    secret = api.client.app.state.sessions._secret  # type: ignore[attr-defined]
    sid = cookie.split(".")[0]
    # Everything the database holds, as text: neither the secret nor the session id is there.
    engine = create_engine(db_url)
    dump = []
    with engine.connect() as conn:
        for table in ("spectune_dashboard_sessions", "spectune_api_tokens"):
            dump += [repr(tuple(row)) for row in conn.execute(text(f"SELECT * FROM {table}"))]
        token_hash = conn.execute(text("SELECT token_hash FROM spectune_api_tokens WHERE role = 'user'")).scalar_one()
    engine.dispose()
    blob = "\n".join(dump)
    assert secret.decode() not in blob and sid not in blob
    # The old scheme's cookie, minted from the stored hash, is refused.
    message = f"1.{int(time.time()) + 10**9}"
    forged = f"{message}.{hmac.new(token_hash.encode(), message.encode(), hashlib.sha256).hexdigest()}"
    # And a cookie of the new shape MAC'd with the token hash instead of the secret.
    fake_sid = "B" * 43
    forged_new = f"{fake_sid}.{hmac.new(token_hash.encode(), fake_sid.encode(), hashlib.sha256).hexdigest()}"
    for value in (forged, forged_new):
        api.client.cookies.clear()
        api.client.cookies.set(SESSION_COOKIE, value)
        assert api.client.get("/api/studies").status_code == 401


def test_the_session_secret_lives_outside_the_database(tmp_path: Path, db_url: str) -> None:
    from api.sessions import load_secret, secret_file_path

    settings = make_settings(db_url, artifact_dir=str(tmp_path / "arts"), session_secret=None)
    path = secret_file_path(settings)
    assert path == tmp_path / "spectune-session-secret" and not path.exists()
    first = load_secret(settings)
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_secret(settings) == first  # the next start reads the same one
    with pytest.raises(ValueError, match="at least 32"):
        load_secret(make_settings(db_url, session_secret="short"))
    explicit = make_settings(db_url, session_secret_file=str(tmp_path / "elsewhere" / "key"), session_secret=None)
    assert load_secret(explicit) != first


def test_revoking_the_token_ends_its_sessions(api: Api) -> None:
    from api.auth import create_token, revoke_token

    ctx = api.client.app.state.ctx  # type: ignore[attr-defined]
    token_id, token = create_token(ctx.sessions, "user", "revoke-me")
    api.client.cookies.clear()
    assert api.client.post("/login", data={"token": token}, follow_redirects=False).status_code == 303
    assert api.client.get("/api/studies").status_code == 200
    revoke_token(ctx.sessions, token_id)
    assert api.client.get("/api/studies").status_code == 401


# ------------------------------------------------------------------- worker scope


def _worker_token(db_url: str, worker_id: str | None = None) -> dict[str, str]:
    from api.auth import create_token
    from api.db import make_engine, make_sessionmaker

    engine = make_engine(db_url)
    try:
        _, token = create_token(make_sessionmaker(engine), "worker", "scope", worker_id=worker_id)
    finally:
        engine.dispose()
    return {"Authorization": f"Bearer {token}"}


def test_an_unbound_worker_token_acts_only_on_leases_it_was_given(api: Api, db_url: str) -> None:
    assert api.post("/v1/studies", "user", small_spec("scope")).status_code == 201
    mine = lease(api, "w1").json()["lease_id"]
    other = _worker_token(db_url)  # another unbound worker token
    missing = "00000000-0000-0000-0000-000000000000"
    bodies = {
        "heartbeat": None,
        "progress": {"step": 0, "concurrency": 1, "output_tok_s": 5.0},
        "complete": ok_metrics(5.0),
    }
    for action, body in bodies.items():
        r = api.client.post(f"/v1/leases/{mine}/{action}", headers=other, json=body)
        nothing = api.client.post(f"/v1/leases/{missing}/{action}", headers=other, json=body)
        assert r.status_code == nothing.status_code == 404, (action, r.text)
        assert _error(r)["message"].replace(mine, missing) == _error(nothing)["message"]
    # Asking for w1's work with the other token is refused: w1 is the first token's (issue 18).
    again = api.client.post("/v1/workers/w1/lease", headers=other, json=INVENTORY)
    assert again.status_code == 403
    assert api.client.post(f"/v1/leases/{mine}/heartbeat", headers=other).status_code == 404
    # The token it was given to still works, and its report is the one recorded.
    assert api.post(f"/v1/leases/{mine}/heartbeat", "worker").status_code == 200
    assert api.post(f"/v1/leases/{mine}/complete", "worker", ok_metrics(90.0)).json()["state"] == "completed"


def test_a_bound_token_cannot_tell_another_workers_lease_from_none(api: Api, db_url: str) -> None:
    assert api.post("/v1/studies", "user", small_spec("bound")).status_code == 201
    w1 = _worker_token(db_url, "w1")
    w2 = _worker_token(db_url, "w2")
    mine = api.client.post("/v1/workers/w1/lease", headers=w1, json=INVENTORY).json()["lease_id"]
    missing = "00000000-0000-0000-0000-000000000000"
    r = api.client.post(f"/v1/leases/{mine}/heartbeat", headers=w2)
    nothing = api.client.post(f"/v1/leases/{missing}/heartbeat", headers=w2)
    assert (r.status_code, _error(r)["message"].replace(mine, "ID")) == (
        nothing.status_code,
        _error(nothing)["message"].replace(missing, "ID"),
    )
    assert r.status_code == 404
    assert api.client.post(f"/v1/leases/{mine}/heartbeat", headers=w1).status_code == 200


# ------------------------------------------------------------------- paths to users


def test_server_log_tails_shown_to_users_carry_no_host_paths(api: Api) -> None:
    from api.artifacts import REDACTED

    assert api.post("/v1/studies", "user", small_spec("paths")).status_code == 201
    base = lease(api).json()
    assert api.post(f"/v1/leases/{base['lease_id']}/complete", "worker", ok_metrics(90.0)).status_code == 200
    trial = lease(api).json()
    tail = (
        "server_args=ServerArgs(model_path='/srv/models/moe-pcie', tokenizer_path='/srv/models/moe-pcie', "
        "speculative_draft_model_path='/srv/models/moe-pcie-eagle3', port=30000)\n"
        "launch: --model-path /srv/models/moe-pcie --speculative-draft-model-path=/srv/models/d\n"
    )
    report = ok_metrics(100.0, log_tail=tail)
    assert api.post(f"/v1/leases/{trial['lease_id']}/complete", "worker", report).status_code == 200
    detail = api.get("/api/studies/1", "user").json()
    t = next(t for t in detail["trials"] if t["artifacts"])
    log = next(a for a in t["artifacts"] if a["filename"] == "server-log-tail.txt")
    text = api.get(f"/artifacts/1/{t['trial_id']}/{log['artifact_id']}", "user").text
    assert "/srv/models" not in text and REDACTED in text and "port=30000" in text


def test_a_dashboard_error_page_becomes_the_documented_500_and_is_counted(db_url: str, tmp_path: Path) -> None:
    from api.app import create_app
    from api.dashboard import DashboardGate

    app = create_app(make_settings(db_url, artifact_dir=str(tmp_path / "artifacts")))
    tokens = make_tokens(db_url)
    h = {"Authorization": f"Bearer {tokens['user']}"}
    with TestClient(app, raise_server_exceptions=False) as client:
        gate = next(r.app for r in app.routes if isinstance(getattr(r, "app", None), DashboardGate))  # type: ignore[attr-defined]

        async def broken(scope: Any, receive: Any, send: Any) -> None:
            # What bottle sends when a view raises: an HTML page that may name the exception.
            page = b"<h1>Critical error</h1><pre>Traceback ... KeyError: 'HTTP_ACCEPT_ENCODING'</pre>"
            await send({"type": "http.response.start", "status": 500, "headers": [(b"content-type", b"text/html")]})
            await send({"type": "http.response.body", "body": page})

        gate._app = broken
        r = client.get("/api/studies", headers=h)
        assert r.status_code == 500 and _error(r)["code"] == "internal"
        assert "Traceback" not in r.text and "KeyError" not in r.text
        metrics = client.get("/metrics", headers=h).text
        assert (
            'spectune_http_unhandled_errors_total{exception="dashboard_500",method="GET",route="dashboard"} 1.0'
            in metrics
        )


def test_a_study_stored_before_the_checks_does_not_break_leasing(api: Api, db_url: str) -> None:
    """A spec accepted by an older version (max_hours 1e300) must not make every lease a 500."""
    from sqlalchemy import create_engine, text

    assert api.post("/v1/studies", "user", small_spec("legacy")).status_code == 201
    assert api.post("/v1/studies", "user", small_spec("healthy")).status_code == 201
    spec = small_spec("legacy", budget={"max_trials": 8, "max_hours": 1e300}, seed=-5)
    engine = create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(text("UPDATE spectune_studies SET spec = :s WHERE name = 'legacy'"), {"s": json.dumps(spec)})
    engine.dispose()
    r = lease(api)
    assert r.status_code == 200 and r.json()["study"] == "healthy", r.text
    # Reading it says what is wrong (409, not 500); it can still be stopped; new studies start.
    r = api.get("/v1/studies/legacy", "user")
    assert r.status_code == 409 and _error(r)["field"] == "budget.max_hours", r.text
    assert "stop it" in _error(r)["message"]
    stopped = api.post("/v1/studies/legacy/stop", "user")
    assert stopped.status_code == 200 and stopped.json()["state"] == "stopped", stopped.text
    shown = [s for s in api.get("/v1/studies", "user").json() if s["name"] == "legacy"]
    assert shown and shown[0]["state"] == "stopped"
    assert api.post("/v1/studies", "user", small_spec("after")).status_code == 201


def test_the_upgrade_stops_studies_whose_spec_fails_the_checks(tmp_path: Path) -> None:
    from alembic import command
    from sqlalchemy import create_engine, text

    from api.schema import alembic_config, upgrade

    url = f"sqlite:///{tmp_path / 'old.db'}"
    upgrade(url)
    command.downgrade(alembic_config(url), "0002")  # the revision before the stricter checks
    engine = create_engine(url)
    bad = small_spec("bad", budget={"max_trials": 8, "max_hours": 1e300})
    with engine.begin() as conn:
        for name, spec in (("bad", bad), ("good", small_spec("good"))):
            conn.execute(
                text(
                    "INSERT INTO spectune_studies (name, state, spec, baseline_key, created_at) "
                    "VALUES (:n, 'running', :s, 'k', CURRENT_TIMESTAMP)"
                ),
                {"n": name, "s": json.dumps(spec)},
            )
        conn.execute(
            text(
                "INSERT INTO spectune_leases (id, study_name, kind, state, worker_id, attempt, payload, created_at) "
                "VALUES ('l1', 'bad', 'baseline', 'active', 'w1', 1, '{}', CURRENT_TIMESTAMP)"
            )
        )
    command.upgrade(alembic_config(url), "head")
    with engine.connect() as conn:
        states = dict(conn.execute(text("SELECT name, state FROM spectune_studies")).all())
        reason = conn.execute(text("SELECT finish_reason FROM spectune_studies WHERE name = 'bad'")).scalar_one()
        lease_state = conn.execute(text("SELECT state FROM spectune_leases WHERE id = 'l1'")).scalar_one()
    engine.dispose()
    assert states == {"bad": "stopped", "good": "running"}
    assert "budget.max_hours" in reason and lease_state == "superseded"
