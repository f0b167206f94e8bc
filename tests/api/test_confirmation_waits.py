"""A confirmation never waits silently, and "fresh baseline" is said only of a fresh one (issue 16).

Seen: w1 refused study X, then measured a baseline for study Y of the same model and workload;
X sat in `phase: confirmation` for 29 minutes while w2 got 204 on every poll (the candidates were
kept away from w2, which had found them, because w1 "could" confirm them), `eligibility` showed
no warning, and the confirmation then ran against a 30-minute-old baseline called fresh.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import select

from api.models import BaselineRow, StudyRow, WorkerRow
from tests.support.api_client import Api
from tests.support.search import lease, ok, sim_levels
from tests.support.specs import small_spec

REFUSED = {
    "outcome": "failed",
    "failure": {"kind": "refused", "message": "server flag(s) --trust-remote-code not on this worker's allowlist"},
}


def _ctx(api: Api) -> Any:
    return api.client.app.state.ctx  # type: ignore[attr-defined]


def _complete(api: Api, got: dict[str, Any]) -> None:
    config = None if got["kind"] == "baseline" else got["config"]
    body = ok(sim_levels("moe-pcie", config, got["workload"]["concurrency"]))
    assert api.post(f"/v1/leases/{got['lease_id']}/complete", "fleet", body).status_code == 200


def _refused_then_searched_elsewhere(api: Api) -> None:
    """X refused by w1, which then measures Y's baseline (same key); w2 runs X's whole search."""
    spec = small_spec("x", budget={"max_trials": 4, "converge": False}, confirmation={"top": 2})
    assert api.post("/v1/studies", "user", spec).status_code == 201
    first = lease(api, "w1")
    assert first is not None and first["study"] == "x"
    assert api.post(f"/v1/leases/{first['lease_id']}/complete", "fleet", REFUSED).status_code == 200
    assert api.post("/v1/studies", "user", small_spec("y")).status_code == 201
    base_y = lease(api, "w1")
    assert base_y is not None and base_y["study"] == "y" and base_y["kind"] == "baseline"
    _complete(api, base_y)
    assert api.post("/v1/studies/y/stop", "user").status_code == 200
    for _ in range(12):  # w2's baseline and the four trials
        got = lease(api, "w2")
        assert got is not None and got["kind"] in ("baseline", "trial")
        _complete(api, got)
        if api.get("/v1/studies/x", "user").json()["phase"] == "confirmation":
            return
    raise AssertionError("the search of x did not end")


def test_a_study_whose_only_capable_worker_refused_it_says_so_at_the_next_read(api: Api) -> None:
    spec = small_spec("lonely", budget={"max_trials": 4, "converge": False})
    assert api.post("/v1/studies", "user", spec).status_code == 201
    first = lease(api, "w1")
    assert first is not None and first["study"] == "lonely"
    assert api.post(f"/v1/leases/{first['lease_id']}/complete", "fleet", REFUSED).status_code == 200
    shown = api.get("/v1/studies/lonely", "user").json()
    assert shown["state"] == "running" and shown["phase"] == "search"
    assert shown["eligibility"]["unmet"] == ["refused"]
    assert "refused what it asks (w1" in shown["eligibility"]["warning"]
    assert lease(api, "w1") is None


def test_a_worker_that_refused_the_study_keeps_no_confirmation_waiting(api: Api) -> None:
    _refused_then_searched_elsewhere(api)
    shown = api.get("/v1/studies/x", "user").json()
    assert shown["state"] == "running" and shown["phase"] == "confirmation"
    assert shown["eligibility"]["warning"] is None  # w2 can confirm: nothing to warn about
    handed = []
    for _ in range(6):
        assert lease(api, "w1") is None  # w1 stays live (it polls) but is never offered x
        got = lease(api, "w2")
        assert got is not None, "w2 was told 'no work' while x's confirmations were queued"
        handed.append(got["kind"])
        _complete(api, got)
        if api.get("/v1/studies/x", "user").json()["state"] != "running":
            break
    # One fresh baseline on w2, then the confirmations there (the only host that may run x).
    assert handed[0] == "baseline" and handed[1:] and set(handed[1:]) == {"confirm"}
    shown = api.get("/v1/studies/x", "user").json()
    # w2 found the candidates and re-measured them: no second token vouches for them (issue 35).
    assert shown["state"] == "finished" and "re-measured only" in shown["finish_reason"]
    assert shown["winner"]["confirmed"] is False and shown["winner"]["confirmed_on"] == "w2"
    assert "no second worker token vouches for it" in shown["verdict"]


def test_a_confirmation_no_live_worker_can_take_says_so_in_one_poll(api: Api) -> None:
    _refused_then_searched_elsewhere(api)
    # w2 goes away (its last poll long ago); w1 refused x.  The very next read says so.
    with _ctx(api).write_sessions() as s, s.begin():
        w2 = s.get(WorkerRow, "w2")
        assert w2 is not None
        w2.last_seen = w2.last_seen - timedelta(hours=1)
    shown = api.get("/v1/studies/x", "user").json()
    assert shown["phase"] == "confirmation"
    warning = shown["eligibility"]["warning"]
    assert warning is not None and "confirmation(s) wait" in warning and "refused by w1" in warning
    # w2 back: the warning goes with its first poll, which hands it work.
    assert lease(api, "w2") is not None
    assert api.get("/v1/studies/x", "user").json()["eligibility"]["warning"] is None


def test_a_baseline_left_idle_is_measured_again_before_a_confirmation(api: Api) -> None:
    _refused_then_searched_elsewhere(api)
    base = lease(api, "w2")
    assert base is not None and base["kind"] == "baseline"
    _complete(api, base)
    # Half an hour passes with w2 doing nothing for x: age its baselines and the confirmation.
    ctx = _ctx(api)
    with ctx.write_sessions() as s, s.begin():
        for row in s.scalars(select(BaselineRow).where(BaselineRow.worker_id == "w2")):
            row.measured_at -= timedelta(minutes=30)
        study = s.get(StudyRow, "x")
        assert study is not None and study.confirmation_began_at is not None
        study.confirmation_began_at -= timedelta(minutes=40)
    again = lease(api, "w2")
    assert again is not None and again["kind"] == "baseline", again
    _complete(api, again)
    got = lease(api, "w2")
    assert got is not None and got["kind"] == "confirm"
    _complete(api, got)
    shown = api.get("/v1/studies/x", "user").json()
    # Paired with the fresh baseline; but w2 found it, so it is not called confirmed (issue 35).
    assert shown["winner"]["confirmed"] is False
    assert "re-measured only by the worker token that found it" in shown["verdict"]
