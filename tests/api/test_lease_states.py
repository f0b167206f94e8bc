"""The lease state machine (api/services/leasing/states.py) on both backends."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError

from api.models import CONFIG_STATES, LEASE_KINDS, LEASE_STATES, STUDY_STATES, LeaseRow
from api.services.leasing.states import (
    ConfigState,
    IllegalTransitionError,
    LeaseKind,
    LeaseRaceError,
    LeaseState,
    StudyState,
    move,
)
from optimizer import study as opt
from optimizer.spec import StudySpec
from tests.support.api_client import Api
from tests.support.specs import INVENTORY, small_spec

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def ok(tok_s: float, concurrency: int = 1) -> dict[str, Any]:
    return {"outcome": "ok", "metrics": {"levels": [{"concurrency": concurrency, "output_tok_s": tok_s}]}}


def lost(*levels: tuple[int, float]) -> dict[str, Any]:
    failure: dict[str, Any] = {"kind": "lost", "message": "worker shutting down"}
    failure["levels"] = [{"concurrency": c, "output_tok_s": v} for c, v in levels]
    return {"outcome": "failed", "failure": failure}


def ask(api: Api, worker: str) -> Any:
    r = api.post(f"/v1/workers/{worker}/lease", "worker", INVENTORY)
    assert r.status_code in (200, 204), r.text
    return r.json() if r.status_code == 200 else None


def with_baseline(api: Api, worker: str) -> Any:
    """The worker's baseline, measured; returns its first trial lease."""
    base = ask(api, worker)
    assert base["kind"] == "baseline"
    # A baseline measures every level of its workload (the API refuses a partial one).
    levels = [{"concurrency": c, "output_tok_s": 100.0} for c in base["workload"]["concurrency"]]
    done = api.post(
        f"/v1/leases/{base['lease_id']}/complete", "worker", {"outcome": "ok", "metrics": {"levels": levels}}
    )
    assert done.status_code == 200, done.text
    trial = ask(api, worker)
    assert trial is not None and trial["kind"] == "trial"
    return trial


def ctx_of(api: Api) -> Any:
    return api.client.app.state.ctx  # type: ignore[attr-defined]


def trial_finished_behind_its_lease(api: Api, name: str) -> tuple[Any, Any]:
    """w1 holds a trial lease whose Optuna trial is then finished by someone else."""
    spec = small_spec(name)
    assert api.post("/v1/studies", "user", spec).status_code == 201
    trial = with_baseline(api, "w1")
    ctx = ctx_of(api)
    study = opt.load_study(ctx.storage, StudySpec.model_validate(spec))
    opt.tell_failed(study, trial["trial_number"], {"failure_kind": "test", "failure_message": "finished elsewhere"})
    return trial, ctx


def test_the_database_holds_the_state_machines_vocabulary(api: Api) -> None:
    assert tuple(LeaseState) == LEASE_STATES and tuple(LeaseKind) == LEASE_KINDS
    assert tuple(StudyState) == STUDY_STATES and tuple(ConfigState) == CONFIG_STATES
    assert api.post("/v1/studies", "user", small_spec("v")).status_code == 201
    lease = ask(api, "w1")
    ctx = ctx_of(api)
    with pytest.raises(IntegrityError), ctx.write_sessions() as s, s.begin():
        s.execute(update(LeaseRow).where(LeaseRow.id == lease["lease_id"]).values(state="abandoned"))
    with pytest.raises(IntegrityError), ctx.write_sessions() as s, s.begin():
        s.execute(update(LeaseRow).where(LeaseRow.id == lease["lease_id"]).values(kind="warmup"))


def test_a_move_is_a_compare_and_set(api: Api) -> None:
    assert api.post("/v1/studies", "user", small_spec("cas")).status_code == 201
    lease_id = ask(api, "w1")["lease_id"]
    ctx = ctx_of(api)
    with ctx.write_sessions() as stale_session:
        with stale_session.begin():
            stale = stale_session.scalars(select(LeaseRow).where(LeaseRow.id == lease_id)).one()
        assert stale.state == LeaseState.ACTIVE
        # Another request ends the lease meanwhile.
        with ctx.write_sessions() as s, s.begin():
            move(s, s.get(LeaseRow, lease_id), LeaseState.FAILED)
        # The stale reader's move finds the row no longer active: it must not win.
        with pytest.raises(LeaseRaceError), stale_session.begin():
            move(stale_session, stale, LeaseState.COMPLETED)
    with ctx.write_sessions() as s, s.begin():
        ended = s.get(LeaseRow, lease_id)
        assert ended.state == LeaseState.FAILED
        # An ended lease never becomes active again: its id is never handed out twice.
        with pytest.raises(IllegalTransitionError):
            move(s, ended, LeaseState.ACTIVE)


def test_a_lease_whose_trial_finished_elsewhere_is_ended_and_never_handed_back(api: Api) -> None:
    trial, ctx = trial_finished_behind_its_lease(api, "fin")

    # Progress learns it: 409, and the lease is over for good.
    r = api.post(
        f"/v1/leases/{trial['lease_id']}/progress", "worker", {"step": 0, "concurrency": 1, "output_tok_s": 90.0}
    )
    assert r.status_code == 409, r.text
    assert "already finished" in r.json()["error"]["message"]
    with ctx.sessions() as s:
        assert s.get(LeaseRow, trial["lease_id"]).state == LeaseState.SUPERSEDED
    again = ask(api, "w1")
    assert again is None or again["lease_id"] != trial["lease_id"]


def test_asking_again_for_a_lease_whose_trial_finished_gets_other_work(api: Api) -> None:
    trial, ctx = trial_finished_behind_its_lease(api, "fin2")
    # The worker restarted and asks while its lease is live: the lease is not handed back.
    again = ask(api, "w1")
    assert again is not None and again["lease_id"] != trial["lease_id"]
    assert again["trial_number"] != trial["trial_number"]
    with ctx.sessions() as s:
        assert s.get(LeaseRow, trial["lease_id"]).state == LeaseState.SUPERSEDED


def test_a_trial_out_of_attempts_ends_with_its_failure_and_the_levels_it_measured(db_url: str, tmp_path) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from tests.support.api_client import make_settings, make_tokens

    spec = small_spec("give-up")
    spec["workload"] = {**spec["workload"], "concurrency": [1, 4]}
    settings = make_settings(db_url, max_attempts=2, artifact_dir=str(tmp_path / "a"))
    with TestClient(create_app(settings)) as client:
        api = Api(client, make_tokens(db_url))
        assert api.post("/v1/studies", "user", spec).status_code == 201
        first = with_baseline(api, "w1")
        # Three graceful shutdowns were seen to end a trial with no failure kind and no message.
        r = api.post(f"/v1/leases/{first['lease_id']}/complete", "worker", lost((1, 95.0)))
        assert r.status_code == 200 and r.json()["state"] == "failed", r.text
        retry = ask(api, "w1")
        assert retry["trial_number"] == first["trial_number"] and retry["attempt"] == 2
        assert retry["lease_id"] != first["lease_id"]
        r = api.post(f"/v1/leases/{retry['lease_id']}/complete", "worker", lost())
        assert r.status_code == 200, r.text
        trials = {t["number"]: t for t in api.get("/v1/studies/give-up/trials", "user").json()}
        told = trials[first["trial_number"]]
        assert told["state"] == "FAIL"
        assert told["failure_kind"] == "lost"
        assert "worker shutting down" in told["failure_message"] and "2 attempts" in told["failure_message"]
        assert [lv["concurrency"] for lv in told["levels_measured"]] == [1]
        assert told["levels_measured"][0]["output_tok_s"] == 95.0
        # The lost reports counted nothing against the host.
        workers = {w["id"]: w for w in api.get("/v1/workers", "user").json()}
        assert workers["w1"]["state"] == "ok"


def test_storage_errors_are_503_with_retry_after_and_no_trace(api: Api) -> None:
    from optuna.exceptions import StorageInternalError

    app = api.client.app

    @app.get("/v1/test-storage-error")  # type: ignore[misc,untyped-decorator]
    def _boom() -> None:
        raise StorageInternalError("sqlite3.OperationalError: database is locked")

    # Registered after the catch-all: move it to the front so it is reached.
    app.router.routes.insert(0, app.router.routes.pop())
    r = api.get("/v1/test-storage-error", "user")
    assert r.status_code == 503
    assert r.headers["retry-after"].isdigit()
    assert r.json()["error"]["code"] == "storage_unavailable"
    assert "sqlite3" not in r.text and "locked" not in r.text
