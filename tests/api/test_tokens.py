"""Tokens: shown once, stored only as a hash, revocable with `spectune token revoke` (real CLI)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy import text

from api.app import create_app
from api.db import make_engine
from tests.support.api_client import make_settings


def cli(*args: str, db_url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "api.cli", *args, "--database-url", db_url],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "TZ": "UTC"},
    )


def _all_token_columns(db_url: str) -> str:
    engine = make_engine(db_url)
    try:
        with engine.connect() as c:
            rows = c.execute(text("SELECT * FROM spectune_api_tokens")).all()
        return "\n".join(" ".join(str(v) for v in row) for row in rows)
    finally:
        engine.dispose()


def test_a_token_is_stored_only_as_its_hash_and_revocation_locks_it_out(db_url: str) -> None:
    created = cli("token", "create", "--role", "user", "--name", "alice", db_url=db_url)
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip()
    assert token.startswith("st_") and len(token) > 40
    stored = _all_token_columns(db_url)
    assert hashlib.sha256(token.encode()).hexdigest() in stored
    assert token not in stored and token[3:] not in stored
    if db_url.startswith("sqlite:///"):
        # Not in the file either (no WAL page or free page keeps it).
        files = [Path(db_url.removeprefix("sqlite:///"))]
        files += [Path(str(files[0]) + suffix) for suffix in ("-wal", "-journal")]
        for f in files:
            if f.exists():
                assert token.encode() not in f.read_bytes(), f

    listed = cli("token", "list", db_url=db_url)
    assert listed.returncode == 0 and token not in listed.stdout
    token_id = next(line.split("\t")[0] for line in listed.stdout.splitlines() if line.endswith("alice"))

    with TestClient(create_app(make_settings(db_url))) as client:
        headers = {"Authorization": f"Bearer {token}"}
        assert client.get("/v1/studies", headers=headers).status_code == 200
        revoked = cli("token", "revoke", token_id, db_url=db_url)
        assert revoked.returncode == 0 and f"token {token_id} revoked" in revoked.stdout, revoked.stderr
        # Takes effect at once, in a server that was already running (no cache of tokens).
        r = client.get("/v1/studies", headers=headers)
        assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]
    assert f"{token_id}\tuser\trevoked\talice" in cli("token", "list", db_url=db_url).stdout


def test_revoking_an_unknown_token_is_a_clear_error(db_url: str) -> None:
    r = cli("token", "revoke", "999999", db_url=db_url)
    assert r.returncode == 2 and "no token with id 999999" in r.stderr
