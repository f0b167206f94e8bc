"""A lease never queues on a study another request works on (issue 18: lease p50 5 s at 100 studies).

Every worker asked the oldest running study first and waited for its lock, so asks of all the
fleet were served one at a time.  A lease now takes a study's lock only if it is free and moves on
to the next study; only when no free study has work for it does it wait for a busy one (with a
single running study every worker still gets its turn).  Postgres: the lock is an advisory lock,
held here by a second connection as a request working on the study would hold it.  No timed
assertion: the test watches `pg_locks` for a lease waiting on the lock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from fastapi.testclient import TestClient

from api.db import advisory_lock_key
from tests.support.api_client import Api, make_settings, make_tokens
from tests.support.helpers import ok_result, study_lock_held
from tests.support.specs import INVENTORY, small_spec

pytestmark = pytest.mark.postgres


@pytest.fixture
def pg_api(pg_db_url: str, tmp_path: Path) -> Iterator[Api]:
    from api.app import create_app

    tokens = make_tokens(pg_db_url)
    with TestClient(create_app(make_settings(pg_db_url, artifact_dir=str(tmp_path / "artifacts")))) as client:
        yield Api(client, tokens)


def _measure_baseline(api: Api) -> None:
    r = api.post("/v1/workers/w1/lease", "worker", INVENTORY)
    assert r.status_code == 200 and r.json()["kind"] == "baseline", r.text
    assert api.post(f"/v1/leases/{r.json()['lease_id']}/complete", "worker", ok_result()).status_code == 200


def _lease_in_thread(api: Api) -> tuple[threading.Thread, list[Any]]:
    answer: list[Any] = []
    thread = threading.Thread(target=lambda: answer.append(api.post("/v1/workers/w1/lease", "worker", INVENTORY)))
    thread.start()
    return thread, answer


# A lease waiting for the study's lock, in this test's database only: pg_locks lists every
# database's locks, and on a shared server other tests' leases wait on their own studies' locks
# (issue 35: this test failed on a busy machine, "the lease queued on the older study's lock").
_WAITING = """
    SELECT count(*) FROM pg_locks
    WHERE locktype = 'advisory' AND NOT granted AND objsubid = 1
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND classid = %s::bigint::oid AND objid = %s::bigint::oid
"""


def _until_answered_or_waiting(conn: psycopg.Connection[Any], thread: threading.Thread, study: str) -> bool:
    """Watch until the lease is answered (False) or waits on `study`'s lock (True); bounded."""
    key = advisory_lock_key(f"study:{study}") & 0xFFFFFFFFFFFFFFFF  # bigint key: high, low 32 bits
    for _ in range(1200):  # at most ~60 s
        if not thread.is_alive():
            return False
        row = conn.execute(_WAITING, (key >> 32, key & 0xFFFFFFFF)).fetchone()
        if row and int(row[0]) > 0:
            return True
        time.sleep(0.05)
    raise AssertionError("the lease neither answered nor waited")


def test_a_lease_passes_over_a_study_another_request_works_on(pg_api: Api, pg_db_url: str) -> None:
    for name in ("older", "newer"):
        assert pg_api.post("/v1/studies", "user", small_spec(name)).status_code == 201
    _measure_baseline(pg_api)
    with study_lock_held(pg_db_url, "older") as holder:
        thread, answer = _lease_in_thread(pg_api)
        waited = _until_answered_or_waiting(holder, thread, "older")
        # Answered while the older study's lock was still held: from the next study, never queued.
        assert not waited, "the lease queued on the older study's lock"
        thread.join(timeout=60)
        assert answer[0].status_code == 200 and answer[0].json()["study"] == "newer", answer[0].text
    # Free again: the oldest study is served first, as before.
    done = pg_api.post(f"/v1/leases/{answer[0].json()['lease_id']}/complete", "worker", ok_result())
    assert done.status_code == 200
    assert pg_api.post("/v1/workers/w1/lease", "worker", INVENTORY).json()["study"] == "older"


def test_with_one_running_study_a_lease_waits_its_turn(pg_api: Api, pg_db_url: str) -> None:
    assert pg_api.post("/v1/studies", "user", small_spec("only")).status_code == 201
    _measure_baseline(pg_api)
    with study_lock_held(pg_db_url, "only") as holder:
        thread, answer = _lease_in_thread(pg_api)
        # No other study has work: it waits for the busy one instead of "no work now" (204).
        assert _until_answered_or_waiting(holder, thread, "only"), "the lease did not wait for the only study"
    thread.join(timeout=60)
    assert answer[0].status_code == 200 and answer[0].json()["kind"] == "trial", answer[0].text


def test_expiry_takes_the_studys_lock_before_it_writes(pg_api: Api, pg_db_url: str) -> None:
    """Expiry wrote a study's expired leases, then waited for the study's row to settle it: the
    lock order that deadlocked the report path (b6da51c).  It takes the study's lock first now,
    and passes over a study another request holds."""
    from sqlalchemy import text

    from api.services.leasing.service import LeaseService

    assert pg_api.post("/v1/studies", "user", small_spec("stale")).status_code == 201
    _measure_baseline(pg_api)
    trial = pg_api.post("/v1/workers/w1/lease", "worker", INVENTORY).json()
    ctx = pg_api.client.app.state.ctx  # type: ignore[attr-defined]
    with ctx.engine.begin() as conn:  # the worker went silent an hour ago
        conn.execute(
            text("UPDATE spectune_leases SET deadline = deadline - interval '2 hours' WHERE id = :id"),
            {"id": trial["lease_id"]},
        )

    def state() -> str:
        with ctx.engine.connect() as conn:
            found = conn.execute(text("SELECT state FROM spectune_leases WHERE id = :id"), {"id": trial["lease_id"]})
            return str(found.scalar_one())

    service = LeaseService(ctx)
    with study_lock_held(pg_db_url, "stale"):
        assert service.reclaim_expired() == 0
        assert state() == "active", "expiry wrote a lease of a study whose lock another request holds"
    assert service.reclaim_expired() == 1
    assert state() == "expired"


def test_a_protocol_call_closed_under_it_is_a_retryable_503() -> None:
    """Issue 35: on a busy machine the lease route raised anyio's ClosedResourceError unhandled
    (a 500 and a traceback); it is a busy answer the worker retries."""
    from functools import partial
    from types import SimpleNamespace

    import anyio

    from api.errors import BusyError
    from api.routes.leases import _protocol_thread

    def closed() -> None:
        raise anyio.ClosedResourceError

    async def call() -> None:
        request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(protocol_threads=anyio.CapacityLimiter(1))))
        await _protocol_thread(request, partial(closed))  # type: ignore[arg-type]

    with pytest.raises(BusyError) as busy:
        anyio.run(call)
    assert busy.value.status == 503
