"""Responsive under load (issue 18, item 5): probes, listings, per-user limits, honest 503s.

A hostile-input review saw `/healthz` wait 19.6 s (a sync handler queued behind the thread
pool), `GET /v1/studies` take 46 s at 300 studies (every Optuna study loaded), and 12 leases at
once for one worker id answered 1-2 x 503 per round (an ORM misuse reported as "database
unavailable").  The figures under load are in benchmarks/README.md ("API load, many studies");
these tests hold the mechanisms, with no timed assertion.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from fastapi.testclient import TestClient
from optuna.exceptions import StorageInternalError
from sqlalchemy import Engine, event
from sqlalchemy.exc import InvalidRequestError, OperationalError

from api.errors import storage_unavailable
from tests.support.api_client import Api, make_settings, make_tokens
from tests.support.db import pg_admin
from tests.support.helpers import api_server, run_threads
from tests.support.specs import INVENTORY, small_spec


def ok(levels: list[int]) -> dict[str, Any]:
    return {"outcome": "ok", "metrics": {"levels": [{"concurrency": c, "output_tok_s": 100.0} for c in levels]}}


# ---------------------------------------------------------------------------- listing studies


def _count_statements(engines: list[Engine]) -> tuple[list[int], Any]:
    seen = [0]

    def count(*_: Any) -> None:
        seen[0] += 1

    for e in engines:
        event.listen(e, "before_cursor_execute", count)

    def remove() -> None:
        for e in engines:
            event.remove(e, "before_cursor_execute", count)

    return seen, remove


def test_listing_studies_costs_the_same_queries_for_2_or_10_studies(api: Api) -> None:
    ctx = api.client.app.state.ctx  # type: ignore[attr-defined]
    engines = list({id(e): e for e in (ctx.engine, ctx.read_engine or ctx.engine, ctx.rdb.engine)}.values())

    def listed() -> tuple[int, list[dict[str, Any]]]:
        seen, remove = _count_statements(engines)
        try:
            r = api.get("/v1/studies", "user")
        finally:
            remove()
        assert r.status_code == 200, r.text
        return seen[0], r.json()

    for i in range(2):
        assert api.post("/v1/studies", "user", small_spec(f"few-{i}")).status_code == 201
    # Some trials, so the counts are not all zero: a baseline, then one trial handed out.
    base = api.post("/v1/workers/w1/lease", "worker", INVENTORY).json()
    assert api.post(f"/v1/leases/{base['lease_id']}/complete", "worker", ok([1])).status_code == 200
    assert api.post("/v1/workers/w1/lease", "worker", INVENTORY).json()["kind"] == "trial"
    few, _ = listed()
    for i in range(8):
        assert api.post("/v1/studies", "user", small_spec(f"many-{i}")).status_code == 201
    many, doc = listed()
    assert many == few, f"listing 10 studies ran {many} statements, 2 studies {few}: one more per study"
    assert [d["name"] for d in doc] == ["few-0", "few-1"] + [f"many-{i}" for i in range(8)]
    # The same counts as each study's own page (which reads them through Optuna).
    for d in doc:
        assert d["trials"] == api.get(f"/v1/studies/{d['name']}", "user").json()["trials"], d["name"]
        assert d["model"] == "moe-pcie"
    assert sum(d["trials"]["RUNNING"] for d in doc) == 1


def test_reads_are_answered_while_every_protocol_thread_waits_on_a_lock(pg_db_url: str, tmp_path: Path) -> None:
    """The lease protocol's calls have request threads of their own (api/routes/leases.py): with
    each of them waiting on a lock, a listing is still answered.  In one shared pool the waiting
    leases held every thread and the listing queued behind them."""
    tokens = make_tokens(pg_db_url)
    user, worker = ({"Authorization": f"Bearer {tokens[r]}"} for r in ("user", "worker"))
    dbname = pg_db_url.rsplit("/", 1)[1]
    env = {"SPECTUNE_PROTOCOL_THREADS": "2", "SPECTUNE_REQUEST_THREADS": "4"}
    with api_server(pg_db_url, log_path=tmp_path / "api.log", env=env) as url:
        assert httpx.post(f"{url}/v1/studies", json=small_spec("s"), headers=user, timeout=30).status_code == 201
        holder = psycopg.connect(f"host=127.0.0.1 port=5432 user=postgres dbname={dbname}")
        answers: list[int] = []
        try:
            holder.execute("LOCK TABLE spectune_leases IN ACCESS EXCLUSIVE MODE")

            def lease(i: int) -> None:
                try:
                    r = httpx.post(f"{url}/v1/workers/w{i}/lease", json=INVENTORY, headers=worker, timeout=120)
                    answers.append(r.status_code)
                except httpx.HTTPError:
                    answers.append(-1)

            # More leases than the protocol threads and the other pool together.
            threads = [threading.Thread(target=lease, args=(i,)) for i in range(6)]
            for t in threads:
                t.start()
            with pg_admin() as admin:
                waiting = 0
                for _ in range(600):  # bounded: up to ~60 s for both protocol threads to queue on the lock
                    row = admin.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock'",
                        (dbname,),
                    ).fetchone()
                    waiting = int(row[0]) if row else 0
                    if waiting >= 2:
                        break
                    time.sleep(0.1)
            assert waiting >= 2, f"only {waiting} leases queued on the lock"
            r = httpx.get(f"{url}/v1/studies", headers=user, timeout=20)
            assert r.status_code == 200 and [d["name"] for d in r.json()] == ["s"], r.text
        finally:
            holder.rollback()
            holder.close()
        for t in threads:
            t.join(timeout=120)
    # Once the lock is gone every lease is answered (a baseline each, or "busy, retry").
    assert len(answers) == 6 and set(answers) <= {200, 204, 503}, answers


# ---------------------------------------------------------------------------- per-user limits


@pytest.fixture
def limited(db_url: str, tmp_path: Path) -> Iterator[Api]:
    from api.app import create_app

    tokens = make_tokens(db_url)
    settings = make_settings(db_url, artifact_dir=str(tmp_path / "artifacts"), max_running_studies_per_user=2)
    with TestClient(create_app(settings)) as client:
        yield Api(client, tokens)


def test_a_token_gets_429_naming_the_limit_beyond_its_running_studies(limited: Api) -> None:
    api = limited
    for name in ("mine-a", "mine-b"):
        assert api.post("/v1/studies", "user", small_spec(name)).status_code == 201
    r = api.post("/v1/studies", "user", small_spec("mine-c"))
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    assert error["code"] == "limit_reached"
    assert "SPECTUNE_MAX_RUNNING_STUDIES_PER_USER=2" in error["message"] and "stop one" in error["message"]
    # Nothing was stored for the refused study, and its name is still free.
    assert api.get("/v1/studies/mine-c", "user").status_code == 404
    # Another token has its own allowance.
    assert api.post("/v1/studies", "admin", small_spec("theirs")).status_code == 201
    # A stopped study no longer counts; resuming it is held to the same limit.
    assert api.post("/v1/studies/mine-a/stop", "user").status_code == 200
    assert api.post("/v1/studies", "user", small_spec("mine-c")).status_code == 201
    r = api.post("/v1/studies/mine-a/resume", "user")
    assert r.status_code == 429, r.text
    assert api.get("/v1/studies/mine-a", "user").json()["state"] == "stopped"
    assert api.post("/v1/studies/mine-b/stop", "user").status_code == 200
    assert api.post("/v1/studies/mine-a/resume", "user").json()["state"] == "running"


# ---------------------------------------------------------------------------- 503 means storage


def test_only_an_unreachable_database_is_a_503() -> None:
    down = OperationalError("SELECT 1", {}, Exception("connection refused"))
    bug = InvalidRequestError("Instance <LeaseRow> is not present in this Session")
    assert storage_unavailable(down)
    assert not storage_unavailable(bug)
    try:
        raise StorageInternalError("commit failed") from down
    except StorageInternalError as e:
        assert storage_unavailable(e)
    try:
        raise StorageInternalError("commit failed") from bug
    except StorageInternalError as e:
        assert not storage_unavailable(e)


def test_twelve_leases_at_once_for_one_worker_get_one_lease_and_no_503(db_url: str, tmp_path: Path) -> None:
    tokens = make_tokens(db_url)
    user = {"Authorization": f"Bearer {tokens['user']}"}
    worker = {"Authorization": f"Bearer {tokens['worker']}"}
    log = tmp_path / "api.log"
    with api_server(db_url, log_path=log) as url, httpx.Client(base_url=url, timeout=60) as client:
        # A new baseline key every round (output_len differs): each round races to create a
        # baseline lease, where the losers' insert meets the one-active-lease-per-worker index.
        for round_ in range(4):
            spec = small_spec(f"race-{round_}")
            spec["workload"]["output_len"] = 32 + round_
            assert client.post("/v1/studies", json=spec, headers=user).status_code == 201
            answers = run_threads(
                lambda _: httpx.post(f"{url}/v1/workers/same/lease", json=INVENTORY, headers=worker, timeout=60), 12
            )
            statuses = sorted(r.status_code for r in answers)
            assert len(answers) == 12 and set(statuses) <= {200, 204}, (
                round_,
                [(r.status_code, r.text[:200]) for r in answers],
            )
            leases = {r.json()["lease_id"] for r in answers if r.status_code == 200}
            assert len(leases) == 1, (round_, leases)
            (lease_id,) = leases
            kind = next(r.json()["kind"] for r in answers if r.status_code == 200)
            assert kind == "baseline", kind
            r = client.post(f"/v1/leases/{lease_id}/complete", json=ok([1]), headers=worker)
            assert r.status_code == 200, r.text
            assert client.post(f"/v1/studies/race-{round_}/stop", headers=user).status_code == 200
    text = log.read_text(errors="replace")
    assert "Traceback" not in text and "database error" not in text, text[-3000:]


# ---------------------------------------------------------------------------- /healthz


@pytest.mark.postgres
def test_healthz_answers_while_every_request_thread_waits_on_the_database(pg_db_url: str, tmp_path: Path) -> None:
    """Every thread of the server's pool blocked on a table lock: the probe still answers.

    50 requests hold every request thread (`request_threads`, fewer than the 30 database
    connections), each waiting on the lock, and the rest queue for a thread.  A sync /healthz
    would queue behind them until the lock is released (after this test's 20 s client time-out).
    """
    from api.settings import Settings

    pool = Settings().request_threads
    tokens = make_tokens(pg_db_url)
    user = {"Authorization": f"Bearer {tokens['user']}"}
    dbname = pg_db_url.rsplit("/", 1)[1]
    with api_server(pg_db_url, log_path=tmp_path / "api.log") as url:
        holder = psycopg.connect(f"host=127.0.0.1 port=5432 user=postgres dbname={dbname}")
        try:
            holder.execute("LOCK TABLE spectune_api_tokens IN ACCESS EXCLUSIVE MODE")
            answers: list[int] = []

            def read() -> None:
                try:
                    answers.append(httpx.get(f"{url}/v1/studies", headers=user, timeout=120).status_code)
                except httpx.HTTPError:
                    answers.append(-1)

            threads = [threading.Thread(target=read) for _ in range(50)]
            for t in threads:
                t.start()
            with pg_admin() as admin:
                waiting = 0
                for _ in range(600):  # bounded: up to ~60 s for every thread's backend to queue on the lock
                    row = admin.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock'",
                        (dbname,),
                    ).fetchone()
                    waiting = int(row[0]) if row else 0
                    if waiting >= pool:
                        break
                    time.sleep(0.1)
            assert waiting >= pool, f"only {waiting} of {pool} request threads queued on the lock"
            r = httpx.get(f"{url}/healthz", timeout=20)
            assert r.status_code == 200 and r.json() == {"status": "ok"}
        finally:
            holder.rollback()
            holder.close()
        for t in threads:
            t.join(timeout=120)
    # Once the lock is gone every request is answered: with the studies, or "busy, retry".
    assert len(answers) == 50 and set(answers) <= {200, 503}, answers
