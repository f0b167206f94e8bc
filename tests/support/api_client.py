"""The app in-process: settings for a test database, a token per role, and `Api`, a TestClient
that sends each request with its role's token."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient


def make_settings(db_url: str, **overrides: Any) -> Any:
    from api.settings import Settings

    # A fixed session secret: tests that want the file-based one pass session_secret=None.
    base: dict[str, Any] = {
        "database_url": db_url,
        "heartbeat_interval_s": 1.0,
        "lease_ttl_s": 30.0,
        # In-process tests play workers that never heartbeat: their worker is lost at the lease's
        # TTL (30 beats of 1 s), as before; tests of the loss itself ask for the service's 1.5.
        "lost_after_beats": 30.0,
        # No estimate at creation (seconds of rehearsals per study); tests/api/test_estimate.py asks for one.
        "estimate_draws": 0,
        "session_secret": "test-session-secret-" + "x" * 32,
    }
    base.update(overrides)
    return Settings(**base)


class Api:
    """A TestClient with one token per role.

    Role "fleet" is a fleet of worker hosts, each with a token of its own (a confirmation counts
    only from another token than the one that found its candidate, issue 35): asking as worker id
    W uses W's token (made on first use), and a lease's heartbeat, progress and report go with the
    token it was handed to.  Role "worker" is one token for every worker id.
    """

    def __init__(self, client: TestClient, tokens: dict[str, str], db_url: str | None = None) -> None:
        self.client = client
        self.tokens = tokens
        self.db_url = db_url
        self.host_tokens: dict[str, str] = {}
        self.lease_tokens: dict[str, str] = {}

    def h(self, role: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[role]}"}

    def host_token(self, worker_id: str) -> str:
        if worker_id not in self.host_tokens:
            from api.auth import create_token
            from api.db import make_engine, make_sessionmaker

            assert self.db_url is not None, "role 'fleet' needs the Api's db_url"
            engine = make_engine(self.db_url)
            try:
                self.host_tokens[worker_id] = create_token(make_sessionmaker(engine), "worker", f"host-{worker_id}")[1]
            finally:
                engine.dispose()
        return self.host_tokens[worker_id]

    def _fleet_token(self, path: str) -> str:
        parts = path.split("/")
        if path.startswith("/v1/workers/") and len(parts) > 4 and parts[4] == "lease":
            return self.host_token(parts[3])
        if path.startswith("/v1/leases/") and len(parts) > 3 and parts[3] in self.lease_tokens:
            return self.lease_tokens[parts[3]]
        return self.tokens["worker"]

    def post(self, path: str, role: str, json: Any = None, **kw: Any) -> Any:
        if role != "fleet":
            return self.client.post(path, headers=self.h(role), json=json, **kw)
        token = self._fleet_token(path)
        r = self.client.post(path, headers={"Authorization": f"Bearer {token}"}, json=json, **kw)
        if r.status_code == 200 and path.endswith("/lease") and "lease_id" in r.json():
            self.lease_tokens[r.json()["lease_id"]] = token
        return r

    def get(self, path: str, role: str, **kw: Any) -> Any:
        return self.client.get(path, headers=self.h(role), **kw)


def make_tokens(db_url: str) -> dict[str, str]:
    from api.auth import create_token
    from api.db import make_engine, make_sessionmaker

    engine = make_engine(db_url)
    try:
        factory = make_sessionmaker(engine)
        return {role: create_token(factory, role, f"test-{role}")[1] for role in ("admin", "user", "worker")}
    finally:
        engine.dispose()
