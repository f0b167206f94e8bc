"""A confirmation's baseline measured ahead of time never keeps a worker from another study's work.

The conductor may have a worker the search leaves idle measure the confirmation's baseline while
the launches expected to end the search fly (`optimizer.conductor.ready_baseline`).  The lease
service asks each study first as if the worker had other work (`spare=False`): a study that would
hand out such a baseline says so in its Wait, and is asked again (`spare=True`) only when no
study had other work for the worker.  The conductor's answer is replaced here by one that says
exactly that, so the test pins the service's order on SQLite and Postgres (and reads the
snapshots the service builds).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from optimizer import conductor as c
from tests.support.api_client import Api, make_settings, make_tokens
from tests.support.helpers import ok_result, study_lock_held
from tests.support.specs import INVENTORY, small_spec


def test_a_spare_baseline_waits_for_every_other_studys_work(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("older", "newer"):
        assert api.post("/v1/studies", "user", small_spec(name)).status_code == 201
    # The worker's baseline first (both studies share its server and workload).
    r = api.post("/v1/workers/w1/lease", "worker", INVENTORY)
    assert r.status_code == 200 and r.json()["kind"] == "baseline", r.text
    assert api.post(f"/v1/leases/{r.json()['lease_id']}/complete", "worker", ok_result()).status_code == 200

    real = c.next_action
    asked: list[tuple[str, bool]] = []
    seen: dict[str, c.Snapshot] = {}
    newer_has_work = True

    def next_action(snap: c.Snapshot, worker_id: str, *, spare: bool = True) -> c.Action:
        asked.append((snap.spec.name, spare))
        seen[snap.spec.name] = snap
        if snap.spec.name == "older":
            if spare:
                return c.MeasureBaseline(worker_id, for_confirmation=True)
            return c.Wait("the launches in flight end the search", spare_baseline=True)
        return real(snap, worker_id, spare=spare) if newer_has_work else c.Wait("nothing to do")

    monkeypatch.setattr(c, "next_action", next_action)  # as api.services.study_life calls it
    r = api.post("/v1/workers/w1/lease", "worker", INVENTORY)
    assert r.status_code == 200, r.text
    assert (r.json()["study"], r.json()["kind"]) == ("newer", "trial")
    assert ("older", True) not in asked  # never offered the baseline while the other study had work
    assert api.post(f"/v1/leases/{r.json()['lease_id']}/complete", "worker", ok_result()).status_code == 200

    newer_has_work = False
    asked.clear()
    r = api.post("/v1/workers/w1/lease", "worker", INVENTORY)
    assert r.status_code == 200, r.text
    assert (r.json()["study"], r.json()["kind"]) == ("older", "baseline")
    assert asked == [("older", False), ("newer", False), ("older", True)]
    # The snapshot says when each host's latest search launch of the study ended (a baseline
    # measured before it is not the last thing that host measured: conductor.baseline_serves).
    assert set(seen["newer"].search_done) == {"w1"} and not seen["older"].search_done


@pytest.mark.postgres
def test_no_spare_baseline_while_a_study_that_may_have_work_stays_busy(
    pg_db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A study whose lock another request holds past the wait may have work for the worker: the
    worker hears "no work now" (204) and asks again, not another study's early baseline."""
    from api.app import create_app

    with TestClient(create_app(make_settings(pg_db_url, artifact_dir=str(tmp_path / "a")))) as client:
        api = Api(client, make_tokens(pg_db_url))
        for name in ("older", "newer"):
            assert api.post("/v1/studies", "user", small_spec(name)).status_code == 201
        r = api.post("/v1/workers/w1/lease", "worker", INVENTORY)
        assert r.status_code == 200 and r.json()["kind"] == "baseline", r.text
        assert api.post(f"/v1/leases/{r.json()['lease_id']}/complete", "worker", ok_result()).status_code == 200
        asked: list[tuple[str, bool]] = []

        def next_action(snap: c.Snapshot, worker_id: str, *, spare: bool = True) -> c.Action:
            asked.append((snap.spec.name, spare))
            if spare:
                return c.MeasureBaseline(worker_id, for_confirmation=True)
            return c.Wait("the launches in flight end the search", spare_baseline=True)

        monkeypatch.setattr(c, "next_action", next_action)
        with study_lock_held(pg_db_url, "newer"):
            r = api.post("/v1/workers/w1/lease", "worker", INVENTORY)
        assert r.status_code == 204, r.text
        assert asked == [("older", False)]
        # The lock released, nothing has other work: the early baseline is offered.
        r = api.post("/v1/workers/w1/lease", "worker", INVENTORY)
        assert (r.status_code, r.json()["study"], r.json()["kind"]) == (200, "older", "baseline")
