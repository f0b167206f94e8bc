"""optuna-dashboard behind spectune's auth: who may see it, that it is read-only, the login cookie,
the study note and the artifacts (over HTTP against the real app, on SQLite and Postgres)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.test_report import report_spec, run_simulated_study
from tests.support.api_client import Api, make_settings, make_tokens
from tests.support.db import pg_clone, sqlite_clone


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def dash(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Api]:
    """One finished study per backend for the whole module (tests only read it, or use their own
    tokens and cookies); the lease service stores each trial's artifacts before telling it."""
    from api.app import create_app

    tmp = tmp_path_factory.mktemp(f"dash-{request.param}")
    with _database(request, tmp) as db_url:
        tokens = make_tokens(db_url)
        settings = make_settings(db_url, artifact_dir=str(tmp / "artifacts"))
        with TestClient(create_app(settings)) as client:
            spec = report_spec("dash", max_trials=4, concurrency=(1,))
            run_simulated_study(client, tokens, spec)
            yield Api(client, tokens)


@contextmanager
def _database(request: pytest.FixtureRequest, tmp: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield sqlite_clone(request.getfixturevalue("sqlite_template"), tmp)
        return
    with pg_clone(request.getfixturevalue("pg_template"), "spectune_dash") as url:
        yield url


@pytest.fixture(autouse=True)
def _no_cookies(dash: Api) -> None:
    dash.client.cookies.clear()


DASHBOARD_PATHS = ["/", "/dashboard", "/dashboard/studies/1", "/api/studies", "/api/studies/1", "/api/meta",
                   "/static/bundle.js", "/csv/1", "/incompatible-rdb-schema", "/favicon.ico"]  # fmt: skip


def test_without_a_token_everything_of_the_dashboard_is_401(dash: Api) -> None:
    c = dash.client
    for path in DASHBOARD_PATHS:
        r = c.get(path, follow_redirects=False)
        assert r.status_code == 401, path
        assert r.headers["www-authenticate"] == "Bearer"
    # A browser gets a page leading to the login, still with status 401.
    r = c.get("/dashboard/studies/1", headers={"Accept": "text/html"}, follow_redirects=False)
    assert r.status_code == 401 and "/login?next=%2Fdashboard%2Fstudies%2F1" in r.text
    r = c.get("/api/studies", headers={"Authorization": "Bearer st_not-a-token"})
    assert r.status_code == 401 and r.json()["error"]["message"] == "unknown token"
    # Our own API, docs and health check are unchanged.
    assert c.get("/healthz").json() == {"status": "ok"}
    assert c.get("/docs").status_code == 200
    assert c.get("/v1/studies").status_code == 401
    assert "/login" not in c.get("/openapi.json").json()["paths"]


def test_users_and_admins_view_workers_do_not(dash: Api) -> None:
    for role in ("user", "admin"):
        r = dash.get("/api/studies", role)
        assert r.status_code == 200
        assert [s["study_name"] for s in r.json()["study_summaries"]] == ["dash"]
        assert dash.get("/dashboard", role).status_code == 200
    r = dash.get("/api/studies", "worker")
    assert r.status_code == 403 and "worker token may not view the dashboard" in r.json()["error"]["message"]


DESTRUCTIVE: list[tuple[str, str, Any]] = [
    ("DELETE", "/api/studies/1", None),
    ("POST", "/api/studies", {"study_name": "x", "directions": ["maximize"]}),
    ("POST", "/api/studies/1/rename", {"study_name": "y"}),
    ("POST", "/api/trials/1/tell", {"state": "Complete", "values": [9.9]}),
    ("POST", "/api/trials/1/user-attrs", {"user_attrs": {"speedup": 9}}),
    ("PUT", "/api/studies/1/note", {"version": 99, "body": "x"}),
    ("PUT", "/api/studies/1/1/note", {"version": 1, "body": "x"}),
    ("POST", "/api/artifacts/1/1", {"file": "data:text/plain;base64,eA==", "filename": "x"}),
    ("DELETE", "/api/artifacts/1/1/00000000-0000-0000-0000-000000000000", None),
    ("POST", "/incompatible-rdb-schema", None),
]


def test_the_dashboard_is_read_only_even_for_admins(dash: Api) -> None:
    before = dash.get("/v1/studies/dash/trials", "user").json()
    for method, path, body in DESTRUCTIVE:
        for role in ("admin", "user"):
            r = dash.client.request(method, path, headers=dash.h(role), json=body)
            assert r.status_code == 403, (method, path, r.text)
            assert "read-only" in r.json()["error"]["message"]
        # Without a token it is 401, as everywhere.
        assert dash.client.request(method, path, json=body).status_code == 401
    assert dash.get("/v1/studies/dash/trials", "user").json() == before
    assert [s["study_name"] for s in dash.get("/api/studies", "admin").json()["study_summaries"]] == ["dash"]


def test_the_page_hides_the_controls_that_would_answer_403(dash: Api) -> None:
    """Its page carries the read-only style and a script from this origin (its policy allows no
    inline script); tests/api/test_dashboard_browser.py sees the buttons hidden in Chromium."""
    from api.dashboard_readonly import SCRIPT_PATH

    for path in ("/dashboard", "/dashboard/studies/1"):
        r = dash.get(path, "user")
        assert r.status_code == 200 and "script-src 'self'" in r.headers["content-security-policy"]
        head = r.text.split("</head>")[0]
        assert 'button[aria-label="delete study"]' in head and f'<script defer src="{SCRIPT_PATH}">' in head
        assert int(r.headers["content-length"]) == len(r.content)
    # The script is the dashboard's, behind its authentication like every page of it.
    assert dash.client.get(SCRIPT_PATH).status_code == 401
    script = dash.get(SCRIPT_PATH, "user")
    assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
    assert '"Create", "Delete"' in script.text
    # Only the page: the dashboard's JSON is passed as it is.
    assert "spectune-readonly" not in dash.get("/api/meta", "user").text


def test_login_sets_a_strict_httponly_session_cookie(dash: Api) -> None:
    from api.dashboard import SESSION_COOKIE

    c = dash.client
    assert c.get("/login").status_code == 200
    r = c.post("/login", data={"token": "st_wrong"}, follow_redirects=False)
    assert r.status_code == 401 and "unknown token" in r.text and SESSION_COOKIE not in r.headers.get("set-cookie", "")
    r = c.post("/login", data={"token": dash.tokens["worker"]}, follow_redirects=False)
    assert r.status_code == 403
    r = c.post("/login", data={"token": dash.tokens["user"], "next": "//evil.example/x"}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/dashboard"  # no open redirect
    cookie_header = r.headers["set-cookie"].lower()
    assert "httponly" in cookie_header and "samesite=strict" in cookie_header and "path=/" in cookie_header
    value = c.cookies[SESSION_COOKIE]
    assert dash.tokens["user"] not in value  # the cookie never holds the token
    assert c.get("/api/studies").status_code == 200
    # The cookie works for the dashboard only: our API still wants the bearer token.
    assert c.get("/v1/studies").status_code == 401
    # A tampered cookie is refused.
    sid, mac = value.split(".")
    c.cookies.clear()
    c.cookies.set(SESSION_COOKIE, f"{sid[:-1]}{'A' if sid[-1] != 'A' else 'B'}.{mac}")
    assert c.get("/api/studies").status_code == 401
    c.cookies.clear()
    c.post("/login", data={"token": dash.tokens["user"]}, follow_redirects=False)
    assert c.get("/api/studies").status_code == 200
    r = c.post("/logout", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/login"
    assert c.get("/api/studies").status_code == 401


def test_sessions_expire_and_die_with_their_token(dash: Api) -> None:
    from api.auth import create_token, revoke_token
    from api.dashboard import SESSION_COOKIE
    from api.sessions import SessionKeeper

    ctx = dash.client.app.state.ctx  # type: ignore[attr-defined]
    keeper = dash.client.app.state.sessions  # type: ignore[attr-defined]
    c = dash.client
    token_id, token = create_token(ctx.sessions, "user", "to-revoke")
    # A session recorded with a lifetime already over (same secret, as another process would).
    short = SessionKeeper(keeper._secret, ttl_s=-10)
    expired = short.start(ctx.sessions, viewer_of(ctx, token))
    c.cookies.clear()
    c.cookies.set(SESSION_COOKIE, expired)
    r = c.get("/api/studies")
    assert r.status_code == 401 and "expired" in r.json()["error"]["message"]
    c.cookies.clear()
    c.post("/login", data={"token": token}, follow_redirects=False)
    assert c.get("/api/studies").status_code == 200
    revoke_token(ctx.sessions, token_id)
    r = c.get("/api/studies")
    assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]


def test_study_note_and_trial_artifacts(dash: Api) -> None:
    detail = dash.get("/api/studies/1", "user").json()
    note = detail["note"]["body"]
    for part in ("# dash", "**Verdict:**", "## Spec", "## Baseline (no speculation)", "`sim-1`", "## Best so far"):
        assert part in note, part
    # The launch command is the answer's: the server without speculation when the verdict says it
    # does not pay, the speculative deployment otherwise (never a command the verdict contradicts).
    assert "```" in note and "--enable-metrics" in note
    assert ("--speculative-num-steps" in note) != ("speculation does not pay" in note), note
    assert detail["objective_names"] == ["speedup"]  # the metric name the dashboard shows
    # Viewing again does not rewrite an unchanged note.
    assert dash.get("/api/studies/1", "user").json()["note"]["version"] == detail["note"]["version"]

    trial = next(t for t in detail["trials"] if t["artifacts"])
    names = sorted(a["filename"] for a in trial["artifacts"])
    assert names == ["benchmark.json", "server-log-tail.txt"]
    bench = next(a for a in trial["artifacts"] if a["filename"] == "benchmark.json")
    r = dash.get(f"/artifacts/1/{trial['trial_id']}/{bench['artifact_id']}", "user")
    assert r.status_code == 200
    report = json.loads(r.content)
    assert report["outcome"] in ("ok", "failed")
    assert dash.client.get(f"/artifacts/1/{trial['trial_id']}/{bench['artifact_id']}").status_code == 401


def test_store_trial_artifacts_refuses_an_unknown_trial(dash: Api) -> None:
    from api.artifacts import store_trial_artifacts

    ctx = dash.client.app.state.ctx  # type: ignore[attr-defined]
    with pytest.raises(KeyError, match="no trial 999"):
        store_trial_artifacts(ctx, "dash", 999, {"outcome": "ok"})


def viewer_of(ctx: Any, token: str) -> Any:
    from api.auth import authenticate

    with ctx.sessions() as s:
        return authenticate(s, f"Bearer {token}")
