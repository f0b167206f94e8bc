"""Who may call what: every endpoint of the real app × no token, wrong role, revoked token.

The endpoints come from the app's own route table, so an endpoint added later is covered without
touching this file, and `test_every_endpoint_is_classified` fails until someone decides which role
it needs (`ROLE_OF`) or that it is open (`OPEN`).  Requests go through the whole app (middleware,
dependencies, services, the database) on SQLite and Postgres.

Roles (docs/design.md "Security"): `user` endpoints admit user and admin; `admin` only admin; `worker`
only worker tokens (an admin token cannot lease: least privilege, and a mistake by an operator
cannot pose as a GPU host); a worker token can lease and report, nothing else.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.app import create_app
from api.auth import create_token, revoke_token
from api.db import make_engine, make_sessionmaker
from api.settings import Settings
from tests.support.api_client import make_settings, make_tokens
from tests.support.specs import INVENTORY, small_spec

# Open on purpose: liveness, the login page (it must be reachable to sign in), and the OpenAPI
# description (the same for every deployment, no data; see SECURITY.md "Open endpoints").
OPEN: frozenset[tuple[str, str]] = frozenset(
    {
        ("GET", "/healthz"),
        ("GET", "/login"),
        ("POST", "/login"),
        ("GET", "/logout"),
        ("POST", "/logout"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
        ("GET", "/docs/oauth2-redirect"),
        ("GET", "/redoc"),
        # Unknown API paths answer 404/405 in the API's error shape (api.app.install_unknown_api_paths).
        *((m, p) for m in ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS") for p in ("/v1", "/v1/{rest:path}")),
    }
)
# The role each protected endpoint needs ("user": user or admin).
ROLE_OF: dict[tuple[str, str], str] = {
    ("POST", "/v1/studies"): "user",
    ("GET", "/v1/studies"): "user",
    ("GET", "/v1/studies/{name}"): "user",
    ("POST", "/v1/studies/{name}/stop"): "user",
    ("POST", "/v1/studies/{name}/resume"): "user",
    ("GET", "/v1/studies/{name}/trials"): "user",
    ("GET", "/v1/workers"): "user",
    ("POST", "/v1/workers/{worker_id}/release"): "admin",
    ("POST", "/v1/workers/{worker_id}/refusals/clear"): "admin",
    ("POST", "/v1/workers/{worker_id}/lease"): "worker",
    ("POST", "/v1/leases/{lease_id}/heartbeat"): "worker",
    ("POST", "/v1/leases/{lease_id}/progress"): "worker",
    ("POST", "/v1/leases/{lease_id}/complete"): "worker",
    ("GET", "/metrics"): "user",
}
ADMITS = {"user": {"user", "admin"}, "admin": {"admin"}, "worker": {"worker"}}
# Deviations from the design that are reported, not fixed here (the files are others'), as
# (method, path, role) skipped in the matrix with a strict-xfail test of their own.  None now:
# /metrics admitted worker tokens until df6803f.
KNOWN_DEVIATIONS: frozenset[tuple[str, str, str]] = frozenset()

_PARAM = re.compile(r"\{(\w+)(?::[^}]*)?\}")


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: str

    @property
    def key(self) -> tuple[str, str]:
        return (self.method, self.path)


def endpoints(app: FastAPI) -> list[Endpoint]:
    """Every (method, path) the app routes, mounts excluded (the dashboard is tested on its own)."""
    try:  # FastAPI >= 0.16x keeps included routers nested; this walks them.
        from fastapi.routing import iter_route_contexts

        routes: list[Any] = list(iter_route_contexts(app.routes))
    except ImportError:  # pragma: no cover - older FastAPI flattens app.routes itself
        routes = list(app.routes)
    found = set()
    for route in routes:
        methods, path = getattr(route, "methods", None), getattr(route, "path", None)
        if not methods or not path:
            continue
        found |= {Endpoint(m, path) for m in methods if m != "HEAD"}
    return sorted(found, key=lambda e: (e.path, e.method))


def _app_for_listing() -> FastAPI:
    return create_app(Settings(database_url="sqlite:///unused.db"), check_schema=False)


ALL = endpoints(_app_for_listing())
PROTECTED = [e for e in ALL if e.key not in OPEN]


@dataclass
class World:
    client: TestClient
    tokens: dict[str, str]
    revoked: dict[str, str]
    bound_other: str
    lease_id: str

    def call(self, e: Endpoint, token: str | None, *, header: str | None = None) -> Any:
        values = {"name": "s1", "worker_id": "w1", "lease_id": self.lease_id}
        path = _PARAM.sub(lambda m: values.get(m.group(1), "x"), e.path)
        headers = {}
        if header is not None:
            headers["Authorization"] = header
        elif token is not None:
            headers["Authorization"] = f"Bearer {token}"
        return self.client.request(e.method, path, headers=headers, json=_body(e))


def _body(e: Endpoint) -> Any:
    """A valid body, so the answer is about who asks and never about what was sent."""
    if e.method not in ("POST", "PUT", "PATCH"):
        return None
    if e.path == "/v1/studies":
        return small_spec("s2")
    if e.path.endswith("/lease"):
        return INVENTORY
    if e.path.endswith("/progress"):
        return {"step": 0, "concurrency": 1, "output_tok_s": 10.0}
    if e.path.endswith("/complete"):
        return {"outcome": "failed", "failure": {"kind": "lost", "message": "auth matrix"}}
    return None


@pytest.fixture
def world(db_url: str) -> Iterator[World]:
    tokens = make_tokens(db_url)
    engine = make_engine(db_url)
    try:
        factory = make_sessionmaker(engine)
        revoked = {}
        for role in ("admin", "user", "worker"):
            token_id, token = create_token(factory, role, f"revoked-{role}")
            revoke_token(factory, token_id)
            revoked[role] = token
        _, bound_other = create_token(factory, "worker", "bound", worker_id="w-other")
    finally:
        engine.dispose()
    with TestClient(create_app(make_settings(db_url))) as client:
        user = {"Authorization": f"Bearer {tokens['user']}"}
        assert client.post("/v1/studies", json=small_spec("s1"), headers=user).status_code == 201
        r = client.post("/v1/workers/w1/lease", json=INVENTORY, headers={"Authorization": f"Bearer {tokens['worker']}"})
        assert r.status_code == 200, r.text
        yield World(client, tokens, revoked, bound_other, r.json()["lease_id"])


def test_every_endpoint_is_classified() -> None:
    unclassified = [f"{e.method} {e.path}" for e in ALL if e.key not in OPEN and e.key not in ROLE_OF]
    assert not unclassified, (
        f"new endpoint(s) {unclassified}: add each to ROLE_OF (the role it needs) or OPEN in {Path(__file__).name}"
    )
    stale = sorted(set(ROLE_OF) - {e.key for e in ALL})
    assert not stale, f"ROLE_OF names endpoints the app no longer has: {stale}"
    assert len(PROTECTED) >= 12


def test_no_token_malformed_or_unknown_token_is_401_everywhere(world: World) -> None:
    wrong = []
    for e in PROTECTED:
        for header in (None, "", "Bearer", "Bearer ", "Basic dXNlcjpwdw==", "Bearer st_not-a-token", "st_bare"):
            r = world.call(e, None, header=header)
            if r.status_code != 401 or r.headers.get("www-authenticate") != "Bearer":
                wrong.append(f"{e.method} {e.path} with {header!r}: {r.status_code} {r.text[:120]}")
            elif r.json()["error"]["code"] != "unauthorized":
                wrong.append(f"{e.method} {e.path}: 401 without the error body: {r.text[:120]}")
    assert not wrong, "\n".join(wrong)


def test_revoked_tokens_are_401_everywhere(world: World) -> None:
    wrong = []
    for e in PROTECTED:
        for role, token in world.revoked.items():
            r = world.call(e, token)
            if r.status_code != 401 or "revoked" not in r.json()["error"]["message"]:
                wrong.append(f"{e.method} {e.path} revoked {role}: {r.status_code} {r.text[:120]}")
    assert not wrong, "\n".join(wrong)


def test_wrong_role_is_403_and_the_right_role_gets_in(world: World) -> None:
    wrong = []
    # Refusals first: none of them may change anything, so the admitted calls below still work.
    for e in PROTECTED:
        for role in ("admin", "user", "worker"):
            if role in ADMITS[ROLE_OF[e.key]] or (e.method, e.path, role) in KNOWN_DEVIATIONS:
                continue
            r = world.call(e, world.tokens[role])
            if r.status_code != 403 or r.json()["error"]["code"] != "forbidden":
                wrong.append(f"{e.method} {e.path} as {role}: {r.status_code} {r.text[:160]}")
    # Complete last: it ends the lease the other lease endpoints use.
    for e in sorted(PROTECTED, key=lambda e: e.path.endswith("/complete")):
        for role in sorted(ADMITS[ROLE_OF[e.key]]):
            r = world.call(e, world.tokens[role])
            if r.status_code in (401, 403) or r.status_code >= 500:
                wrong.append(f"{e.method} {e.path} as {role} (admitted): {r.status_code} {r.text[:160]}")
    assert not wrong, "\n".join(wrong)


def test_a_bound_worker_token_acts_only_as_its_worker(world: World) -> None:
    for e in PROTECTED:
        if ROLE_OF[e.key] != "worker":
            continue
        r = world.call(e, world.bound_other)
        if "{lease_id}" in e.path:
            # Another worker's lease is answered exactly like a lease that does not exist: the
            # token learns nothing about leases that are not its own.
            missing = "00000000-0000-0000-0000-000000000000"
            nothing = world.client.post(
                e.path.replace("{lease_id}", missing),
                headers={"Authorization": f"Bearer {world.bound_other}"},
                json=_body(e),
            )
            assert r.status_code == nothing.status_code == 404, f"{e.method} {e.path}: {r.status_code} {r.text}"
            assert r.json()["error"]["message"].replace(world.lease_id, missing) == nothing.json()["error"]["message"]
            continue
        assert r.status_code == 403, f"{e.method} {e.path}: {r.status_code} {r.text}"
        assert "w-other" in r.json()["error"]["message"]


def test_worker_token_cannot_scrape_metrics(world: World) -> None:
    r = world.call(Endpoint("GET", "/metrics"), world.tokens["worker"])
    assert r.status_code == 403, r.status_code


def test_open_endpoints_reveal_no_data(world: World) -> None:
    for e in ALL:
        if e.key not in OPEN:
            continue
        r = world.call(e, None)
        assert r.status_code < 500, f"{e.method} {e.path}: {r.status_code}"
        # The study created by the fixture, the worker and the lease are nowhere in them.
        for secret in ("s1", "w1", world.lease_id, *world.tokens.values()):
            if secret in ("s1", "w1"):
                assert f'"{secret}"' not in r.text, f"{e.method} {e.path} shows {secret}"
            else:
                assert secret not in r.text, f"{e.method} {e.path} shows a secret"


DASHBOARD_PATHS = ("/", "/dashboard", "/api/studies", "/api/studies/0", "/static/bundle.js")


def test_the_dashboard_is_never_reachable_unauthenticated(world: World) -> None:
    c = world.client
    for path in DASHBOARD_PATHS:
        for method in ("GET", "HEAD", "POST", "PUT", "DELETE"):
            r = c.request(method, path)
            assert r.status_code == 401, f"{method} {path}: {r.status_code}"
            r = c.request(method, path, headers={"Authorization": f"Bearer {world.revoked['user']}"})
            assert r.status_code == 401, f"{method} {path} revoked: {r.status_code}"
            # A worker token may only lease and report.
            r = c.request(method, path, headers={"Authorization": f"Bearer {world.tokens['worker']}"})
            assert r.status_code == 403, f"{method} {path} worker: {r.status_code}"
        # HTML requests get the sign-in page, still with 401.
        r = c.get(path, headers={"Accept": "text/html"}, follow_redirects=False)
        assert r.status_code == 401 and "/login" in r.text
        # A forged or garbled session cookie is no way in either.
        for cookie in ("1.9999999999.00", "garbage", "1.1.1"):
            r = c.get(path, headers={"Cookie": f"spectune_session={cookie}"})
            assert r.status_code == 401, f"{path} with cookie {cookie!r}: {r.status_code}"


def test_the_dashboard_is_read_only_even_for_admins(world: World) -> None:
    admin = {"Authorization": f"Bearer {world.tokens['admin']}"}
    assert world.client.get("/api/studies", headers=admin).status_code == 200
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        r = world.client.request(method, "/api/studies/0", headers=admin)
        assert r.status_code == 403, f"{method}: {r.status_code}"


def test_a_session_dies_with_its_token(world: World, db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        token_id, token = create_token(make_sessionmaker(engine), "user", "session")
        c = world.client
        r = c.post("/login", data={"token": token, "next": "/api/studies"}, follow_redirects=False)
        assert r.status_code == 303
        cookie = r.cookies.get("spectune_session")
        c.cookies.clear()  # sent explicitly below, so the check does not depend on the jar
        assert cookie and token not in cookie
        assert c.get("/api/studies", headers={"Cookie": f"spectune_session={cookie}"}).status_code == 200
        revoke_token(make_sessionmaker(engine), token_id)
        assert c.get("/api/studies", headers={"Cookie": f"spectune_session={cookie}"}).status_code == 401
        # A worker token cannot sign in.
        r = c.post("/login", data={"token": world.tokens["worker"]}, follow_redirects=False)
        assert r.status_code == 403
    finally:
        engine.dispose()
