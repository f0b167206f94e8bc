"""A worker that dies holding a lease is replaced at once (issue 33).

Seen: `kill -9` of the confirming worker; its lease expired at its 120 s TTL, the two idle workers
got nothing for 5.5 minutes, and the study showed "running" with nothing running and no reason.
Now a worker that missed its heartbeats (`lost_after_beats` intervals of silence, database
clock) is lost: its lease is reclaimed on the next ask, no confirmation waits for it, and the
study document says what was lost while nothing runs.  Here in process, on SQLite and Postgres;
the `kill -9` itself, with real worker processes: tests/e2e/test_lost_worker.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.db import db_now, make_engine, make_sessionmaker
from api.models import LeaseRow
from tests.support.api_client import Api, make_settings, make_tokens
from tests.support.helpers import wait_for
from tests.support.search import lease
from tests.support.specs import INVENTORY, small_spec


@contextmanager
def _api(db_url: str, tmp_path: Path, interval: float) -> Iterator[Api]:
    """An API whose workers beat every `interval` and are lost after the service's 1.5 beats of
    silence; the TTL (60 s) is far beyond anything the tests wait for."""
    from api.app import create_app

    settings = make_settings(
        db_url,
        heartbeat_interval_s=interval,
        lost_after_beats=1.5,
        lease_ttl_s=60.0,
        artifact_dir=str(tmp_path / "artifacts"),
    )
    with TestClient(create_app(settings)) as client:
        yield Api(client, make_tokens(db_url), db_url)


@pytest.fixture
def quick_loss(db_url: str, tmp_path: Path) -> Iterator[Api]:
    with _api(db_url, tmp_path, 0.1) as api:
        yield api


def _state(db_url: str, lease_id: str) -> str:
    engine = make_engine(db_url)
    try:
        with make_sessionmaker(engine)() as s:
            row = s.get(LeaseRow, lease_id)
            assert row is not None
            return row.state
    finally:
        engine.dispose()


def test_a_silent_worker_is_lost_before_its_ttl_and_the_study_says_why(quick_loss: Api, db_url: str) -> None:
    api = quick_loss
    assert api.post("/v1/studies", "user", small_spec("lost")).status_code == 201
    first = lease(api, "w1")
    assert first is not None and first["kind"] == "baseline"
    assert api.get("/v1/studies/lost", "user").json()["waiting"] is None  # something runs

    # A worker without the study's models asks (and so sweeps) until w1 is lost; it gets nothing.
    stranger = {**INVENTORY, "models": []}
    wait_for(
        "w1 to be lost", lambda: lease(api, "w0", stranger) is None and _state(db_url, first["lease_id"]) == "expired"
    )
    doc = api.get("/v1/studies/lost", "user").json()
    assert doc["state"] == "running"
    assert doc["waiting"] is not None and doc["waiting"].startswith("waiting: baseline lease of w1 lost"), doc[
        "waiting"
    ]
    assert "heartbeat intervals of 0.1 s" in doc["waiting"] and "reassigning" in doc["waiting"]
    # Its worker hears the lease is gone (410) and stops; its work goes to the next worker that asks.
    assert api.post(f"/v1/leases/{first['lease_id']}/heartbeat", "fleet").status_code == 410
    second = lease(api, "w2")
    assert second is not None and second["kind"] == "baseline"
    assert api.get("/v1/studies/lost", "user").json()["waiting"] is None


def test_a_beating_worker_is_not_lost(db_url: str, tmp_path: Path) -> None:
    """Heartbeats keep the worker alive however long the work takes: w1 beats while another worker
    sweeps for three lost-worker windows (measured on the database clock).  0.5 s beats: one loop
    of a beat and an ask has 0.75 s on a loaded host."""
    with _api(db_url, tmp_path, 0.5) as api:
        _beat_while_others_sweep(api, db_url)


def _beat_while_others_sweep(api: Api, db_url: str) -> None:
    assert api.post("/v1/studies", "user", small_spec("kept")).status_code == 201
    first = lease(api, "w1")
    assert first is not None
    stranger = {**INVENTORY, "models": []}
    engine = make_engine(db_url)
    try:
        with make_sessionmaker(engine)() as s:
            began = db_now(s)

        def swept_long_enough() -> bool:
            assert api.post(f"/v1/leases/{first['lease_id']}/heartbeat", "fleet").status_code == 200
            assert lease(api, "w0", stranger) is None
            with make_sessionmaker(engine)() as s:
                return (db_now(s) - began).total_seconds() > 3 * 0.75

        wait_for("three lost-worker windows of sweeps", swept_long_enough, interval=0.05)
    finally:
        engine.dispose()
    assert _state(db_url, first["lease_id"]) == "active"
