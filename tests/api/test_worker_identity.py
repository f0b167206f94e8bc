"""Worker identity (issue 18, item 3): a worker id is bound to one token on first use.

Seen: an unbound worker token leased as another worker's id, received its live lease, overwrote
its inventory, and its forged baseline of 0.5 tok/s was used for the real worker's trials in six
studies; its forged crashes quarantined the host and a forged refusal kept a study from it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.api.test_rest_flow import ok_metrics
from tests.support.api_client import Api, make_settings, make_tokens
from tests.support.specs import INVENTORY, small_spec

PROGRESS = {"step": 0, "concurrency": 1, "output_tok_s": 5.0}
REFUSED = {"outcome": "failed", "failure": {"kind": "refused", "message": "flag not on this worker's allowlist"}}


def _token(db_url: str, worker_id: str | None = None) -> tuple[int, dict[str, str]]:
    from api.auth import create_token
    from api.db import make_engine, make_sessionmaker

    engine = make_engine(db_url)
    try:
        token_id, token = create_token(make_sessionmaker(engine), "worker", "identity", worker_id=worker_id)
    finally:
        engine.dispose()
    return token_id, {"Authorization": f"Bearer {token}"}


def _revoke(db_url: str, token_id: int) -> None:
    from api.auth import revoke_token
    from api.db import make_engine, make_sessionmaker

    engine = make_engine(db_url)
    try:
        revoke_token(make_sessionmaker(engine), token_id)
    finally:
        engine.dispose()


def _ask(api: Api, headers: dict[str, str], worker: str, inventory: dict[str, Any] | None = None) -> Any:
    return api.client.post(f"/v1/workers/{worker}/lease", headers=headers, json=inventory or INVENTORY)


def _inventories(api: Api) -> dict[str, dict[str, Any]]:
    return {w["id"]: w["inventory"] for w in api.get("/v1/workers", "user").json()}


def _cannot_act_as(api: Api, intruder: dict[str, str], victim: str, victim_lease: str) -> None:
    """The intruder token cannot lease, register an inventory, heartbeat, progress or complete as `victim`."""
    before = _inventories(api)[victim]
    forged = {**INVENTORY, "hostname": "forged", "models": []}
    r = _ask(api, intruder, victim, forged)
    assert r.status_code == 403, r.text
    assert victim in r.json()["error"]["message"]
    assert _inventories(api)[victim] == before  # the inventory was not overwritten
    for action, body in (("heartbeat", None), ("progress", PROGRESS), ("complete", ok_metrics(0.5))):
        r = api.client.post(f"/v1/leases/{victim_lease}/{action}", headers=intruder, json=body)
        assert r.status_code == 404, (action, r.text)


def test_a_token_bound_on_first_use_cannot_be_impersonated(api: Api, db_url: str) -> None:
    assert api.post("/v1/studies", "user", small_spec("ident")).status_code == 201
    first = api.post("/v1/workers/w1/lease", "worker", INVENTORY).json()  # binds w1 to the "worker" token
    _, intruder = _token(db_url)
    _cannot_act_as(api, intruder, "w1", first["lease_id"])
    # The rightful token still works, and its baseline is the one recorded.
    assert api.post(f"/v1/leases/{first['lease_id']}/heartbeat", "worker").status_code == 200
    done = api.post(f"/v1/leases/{first['lease_id']}/complete", "worker", ok_metrics(90.0))
    assert done.json()["state"] == "completed"
    # The intruder may speak for an id of its own; and then the first token cannot use that one.
    own = _ask(api, intruder, "w2")
    assert own.status_code == 200, own.text
    assert api.post("/v1/workers/w2/lease", "worker", INVENTORY).status_code == 403


def test_a_token_bound_by_an_admin_acts_only_as_its_worker(api: Api, db_url: str) -> None:
    """The must-show: a token bound to id A cannot act as id B (lease, heartbeat, progress,
    complete, inventory), and no other token can use A."""
    assert api.post("/v1/studies", "user", small_spec("bound")).status_code == 201
    _, a = _token(db_url, "gpu-a")
    _, b = _token(db_url, "gpu-b")
    lease_b = _ask(api, b, "gpu-b").json()["lease_id"]
    lease_a = _ask(api, a, "gpu-a").json()["lease_id"]
    _cannot_act_as(api, a, "gpu-b", lease_b)
    # An unbound token cannot take an id an admin bound to a live token either.
    _cannot_act_as(api, api.h("worker"), "gpu-a", lease_a)
    assert api.client.post(f"/v1/leases/{lease_a}/heartbeat", headers=a).status_code == 200


@pytest.fixture
def capped(db_url: str, tmp_path: Path) -> Iterator[Api]:
    from api.app import create_app

    settings = make_settings(db_url, artifact_dir=str(tmp_path / "a"), max_worker_ids_per_token=3)
    with TestClient(create_app(settings)) as client:
        yield Api(client, make_tokens(db_url))


def test_worker_ids_per_token_are_bounded(capped: Api) -> None:
    """150 worker ids x 1 MB inventories from one token made `GET /v1/workers` answer 145 MiB."""
    for i in range(3):
        assert capped.post(f"/v1/workers/w{i}/lease", "worker", INVENTORY).status_code == 204
    r = capped.post("/v1/workers/w3/lease", "worker", INVENTORY)
    assert r.status_code == 429, r.text
    assert "SPECTUNE_MAX_WORKER_IDS_PER_TOKEN=3" in r.json()["error"]["message"]
    assert sorted(_inventories(capped)) == ["w0", "w1", "w2"]
    # Its own ids still work.
    assert capped.post("/v1/workers/w0/lease", "worker", INVENTORY).status_code == 204


def test_a_revoked_holder_passes_the_id_on_and_what_it_recorded_stops_counting(api: Api, db_url: str) -> None:
    old_id, old = _token(db_url)
    assert api.post("/v1/studies", "user", small_spec("refused-one")).status_code == 201
    refused = _ask(api, old, "w1").json()
    assert api.client.post(f"/v1/leases/{refused['lease_id']}/complete", headers=old, json=REFUSED).status_code == 200
    assert api.post("/v1/studies", "user", small_spec("measured")).status_code == 201
    base = _ask(api, old, "w1").json()
    assert base["study"] == "measured" and base["kind"] == "baseline"
    forged = ok_metrics(0.5)  # a stolen token's baseline
    assert api.client.post(f"/v1/leases/{base['lease_id']}/complete", headers=old, json=forged).status_code == 200
    _revoke(db_url, old_id)
    # The host's new token takes w1 over: the refusal ends, and the old baseline no longer counts
    # (both studies share one baseline key, so with it counted this would be a trial).
    _, new = _token(db_url)
    again = _ask(api, new, "w1")
    assert again.status_code == 200, again.text
    assert (again.json()["study"], again.json()["kind"]) == ("refused-one", "baseline")
    assert api.get("/v1/studies/refused-one", "user").json()["refused_by"] == []
    # And the revoked token cannot use w1 any more.
    assert _ask(api, old, "w1").status_code == 401


def test_the_upgrade_binds_ids_in_use_to_their_tokens(db_url: str) -> None:
    from alembic import command
    from sqlalchemy import create_engine, text

    from api.schema import alembic_config

    url = db_url
    command.downgrade(alembic_config(url), "0004")
    live, revoked = _token(url)[0], _token(url)[0]
    _revoke(url, revoked)
    engine = create_engine(url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO spectune_studies (name, state, spec, baseline_key, created_at) "
                "VALUES ('s', 'running', :s, 'k', CURRENT_TIMESTAMP)"
            ),
            {"s": json.dumps(small_spec("s"))},
        )
        for lease_id, worker, token in (("l1", "w1", live), ("l2", "w2", revoked), ("l3", "w1", live)):
            conn.execute(
                text(
                    "INSERT INTO spectune_leases (id, study_name, kind, state, worker_id, attempt, payload, "
                    "created_at, leased_at) VALUES (:id, 's', 'baseline', 'completed', :w, 1, '{}', "
                    "CURRENT_TIMESTAMP, CURRENT_TIMESTAMP)"
                ),
                {"id": lease_id, "w": worker},
            )
            conn.execute(
                text(
                    "INSERT INTO spectune_lease_grants (lease_id, token_id, granted_at) "
                    "VALUES (:id, :t, CURRENT_TIMESTAMP)"
                ),
                {"id": lease_id, "t": token},
            )
    command.upgrade(alembic_config(url), "head")
    with engine.connect() as conn:
        bound = dict(conn.execute(text("SELECT worker_id, token_id FROM spectune_worker_identities")).all())
    assert bound == {"w1": live}  # w2's token was revoked: w2 is bound on its next use
    command.downgrade(alembic_config(url), "0004")
    with engine.connect() as conn:
        conn.execute(text("SELECT count(*) FROM spectune_lease_grants")).scalar_one()
        with pytest.raises(Exception, match="spectune_worker_identities"):
            conn.execute(text("SELECT count(*) FROM spectune_worker_identities"))
    engine.dispose()
    command.upgrade(alembic_config(url), "head")


def _lease_rows(db_url: str, study: str) -> list[tuple[str, str, int | None, int]]:
    """(id, state, trial number, attempt) of every lease of `study`, oldest first."""
    from sqlalchemy import select

    from api.db import make_engine, make_sessionmaker
    from api.models import LeaseRow

    engine = make_engine(db_url)
    try:
        with make_sessionmaker(engine)() as s:
            q = select(LeaseRow).where(LeaseRow.study_name == study).order_by(LeaseRow.created_at, LeaseRow.id)
            return [(r.id, r.state, r.trial_number, r.attempt) for r in s.scalars(q)]
    finally:
        engine.dispose()


@pytest.mark.parametrize("first", ["old token beats", "new token reports"])
def test_binding_a_worker_id_ends_other_tokens_leases_on_it(api: Api, db_url: str, first: str) -> None:
    """Issue 35, item 9.  Seen on cc094f3: unbound W3 leased as gpu-x; an admin then created a
    token bound to gpu-x: the new token completed W3's lease (200) and W3 still heartbeated it."""
    assert api.post("/v1/studies", "user", small_spec("rebind")).status_code == 201
    _, w3 = _token(db_url)
    base = _ask(api, w3, "gpu-x").json()
    done = api.client.post(f"/v1/leases/{base['lease_id']}/complete", headers=w3, json=ok_metrics(100.0))
    assert done.status_code == 200, done.text
    trial = _ask(api, w3, "gpu-x").json()
    assert trial["kind"] == "trial"
    lid = trial["lease_id"]
    _, bound = _token(db_url, worker_id="gpu-x")

    if first == "old token beats":
        r = api.client.post(f"/v1/leases/{lid}/heartbeat", headers=w3)
        assert r.status_code == 409 and "bound to another token" in r.text, r.text  # the worker stops the engine
    r = api.client.post(f"/v1/leases/{lid}/complete", headers=bound, json=ok_metrics(100.0))
    assert r.status_code == 404, r.text  # never the new token's to report
    for call, body in (("heartbeat", None), ("progress", PROGRESS), ("complete", ok_metrics(100.0))):
        r = api.client.post(f"/v1/leases/{lid}/{call}", headers=w3, json=body)
        assert r.status_code in (404, 409), (call, r.status_code, r.text)

    rows = _lease_rows(db_url, "rebind")
    ended = next(r for r in rows if r[0] == lid)
    assert ended[1] == "superseded", rows
    # The trial is queued again, and the bound token's worker gets it as a new lease.
    again = _ask(api, bound, "gpu-x").json()
    assert again["lease_id"] != lid and again["kind"] == "trial" and again["trial_number"] == trial["trial_number"]
    r = api.client.post(f"/v1/leases/{again['lease_id']}/heartbeat", headers=bound)
    assert r.status_code == 200, r.text
