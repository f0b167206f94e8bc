"""Every database wait is bounded (issue 35, item 6).

Seen on cc094f3: `LOCK TABLE trials IN ACCESS EXCLUSIVE MODE` held for 30 s kept `GET /v1/workers`
and `/metrics` waiting 28 s each, with no 503, though SECURITY.md promises one for a busy
database: only `lock_name` set a lock_timeout.  Now every Postgres session has a lock_timeout
and a statement_timeout (api.db.Waits), and hitting one is answered 503 with Retry-After.
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import psycopg
import pytest

from api.db import engine_kwargs
from tests.support.api_client import make_tokens
from tests.support.helpers import api_server
from tests.support.specs import INVENTORY, small_spec

pytestmark = pytest.mark.postgres


def test_every_postgres_session_has_both_bounds() -> None:
    options = engine_kwargs("postgresql+psycopg://127.0.0.1/x")["connect_args"]["options"]
    assert "lock_timeout=" in options and "statement_timeout=" in options, options


# Each table with the reads that need it: /metrics counts Optuna's trials; the fleet listing reads
# each worker's current lease.
@pytest.mark.parametrize(
    ("table", "paths"), [("trials", ["/metrics"]), ("spectune_leases", ["/v1/workers", "/metrics"])]
)
def test_reads_behind_a_held_table_lock_answer_503_with_retry_after(
    pg_db_url: str, tmp_path: Path, table: str, paths: list[str]
) -> None:
    tokens = make_tokens(pg_db_url)
    user = {"Authorization": f"Bearer {tokens['user']}"}
    worker = {"Authorization": f"Bearer {tokens['worker']}"}
    dbname = pg_db_url.rsplit("/", 1)[1]
    env = {"SPECTUNE_DB_LOCK_TIMEOUT_MS": "300"}
    with api_server(pg_db_url, log_path=tmp_path / "api.log", env=env) as url:
        assert httpx.post(f"{url}/v1/studies", json=small_spec("s"), headers=user, timeout=30).status_code == 201
        # A worker holding a lease, so the fleet listing has a lease to read.
        r = httpx.post(f"{url}/v1/workers/w1/lease", json=INVENTORY, headers=worker, timeout=30)
        assert r.status_code == 200, r.text
        holder = psycopg.connect(f"host=127.0.0.1 port=5432 user=postgres dbname={dbname}")
        # Released at the latest after 60 s, so a read that waits for it (cc094f3) ends, 200.
        release = threading.Timer(60, holder.rollback)
        try:
            holder.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
            release.start()
            answers = {path: httpx.get(f"{url}{path}", headers=user, timeout=120) for path in paths}
        finally:
            release.cancel()
            holder.rollback()
            holder.close()
        # The lock is gone: the same reads are answered again.
        after = {path: httpx.get(f"{url}{path}", headers=user, timeout=30).status_code for path in answers}

    for path, r in answers.items():
        assert r.status_code == 503, (path, r.status_code, r.text[:300])
        assert r.headers.get("Retry-After", "").isdigit(), (path, r.headers)
        assert r.json()["error"]["code"] == "storage_unavailable", r.text
    assert after == dict.fromkeys(paths, 200)
