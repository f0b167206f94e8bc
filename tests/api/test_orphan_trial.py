"""Found by the chaos run: a trial Optuna handed out whose lease was never recorded stays RUNNING.

`LeaseService._ask_new` asks Optuna (its own committed transaction), then records the trial's
config and lease in spectune's tables.  If the database goes away in between (the Postgres
restart of `benchmarks/chaos.py` did it) the handler's `tell_failed` cannot reach it either, and if
the API process dies there nothing runs at all: the Optuna trial stays RUNNING forever, no lease
will ever finish it, and the study finished around it.  Since f57b248 the lease service tells
such a trial FAIL once it is older than `SPECTUNE_ORPHAN_GRACE_S`.  Here the crash is
reproduced exactly: Optuna's ask is made the way the API makes it, and the lease step never
happens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from optimizer import study as opt
from optimizer.spec import StudySpec
from spectune_protocol import CompleteIn
from tests.support.api_client import Api, make_settings, make_tokens
from tests.support.helpers import ok_result
from tests.support.specs import INVENTORY, small_spec

OK = CompleteIn.model_validate(ok_result(90.0))


GRACE_S = 0.5


@pytest.fixture
def api(db_url: str) -> Iterator[Api]:
    with TestClient(create_app(make_settings(db_url, orphan_grace_s=GRACE_S))) as client:
        yield Api(client, make_tokens(db_url))


def test_a_trial_asked_but_never_leased_does_not_stay_running(api: Api) -> None:
    spec = small_spec("orphan", budget={"max_trials": 2})
    assert api.post("/v1/studies", "user", json=spec).status_code == 201
    ctx = api.client.app.state.ctx  # type: ignore[attr-defined]
    parsed = StudySpec.model_validate(spec)
    # The API's ask committed, then the process died before the lease was written.
    orphan = opt.ask(opt.load_study(ctx.storage, parsed), parsed).number

    deadline = time.monotonic() + 120  # a hang guard; seconds on an idle machine
    # Baseline, trials, confirmations, until the study is finished; the orphan's grace passes.
    while api.get("/v1/studies/orphan", "user").json()["state"] == "running":
        assert time.monotonic() < deadline, "the study did not finish within 120 s"
        r = api.post("/v1/workers/w1/lease", "worker", json=INVENTORY)
        if r.status_code == 204:
            time.sleep(GRACE_S / 2)
            continue
        assert r.status_code == 200, r.text
        done = api.post(f"/v1/leases/{r.json()['lease_id']}/complete", "worker", json=OK.model_dump(mode="json"))
        assert done.status_code == 200, done.text
    trial = opt.load_study(ctx.storage, parsed).trials[orphan]
    assert trial.state.name == "FAIL", f"trial {orphan} was asked but never leased, and is {trial.state.name}"
    assert "never leased" in str(trial.user_attrs), trial.user_attrs


@pytest.fixture
def local_zone(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """This process in another time zone (Optuna stamps trials with its local wall clock)."""
    monkeypatch.setenv("TZ", request.param)
    time.tzset()
    try:
        yield request.param
    finally:
        monkeypatch.undo()
        time.tzset()


@pytest.mark.parametrize("local_zone", ["America/New_York", "Asia/Tokyo"], indirect=True)
def test_the_orphan_sweep_reads_optunas_local_stamps_in_any_zone(db_url: str, local_zone: str) -> None:
    """Compared in the wrong clock, west of UTC a trial asked a moment ago would look hours old
    (a fresh ask told FAIL), east of it an orphan would never age (RUNNING for good).  Optuna 5
    stores naive UTC whatever the zone (api.optuna_tables); each zone is checked both ways."""
    from api.services.leasing.service import LeaseService

    settings = make_settings(db_url, orphan_grace_s=3600.0)
    with TestClient(create_app(settings)) as client:
        Api(client, make_tokens(db_url)).post("/v1/studies", "user", json=small_spec("zoned"))
        ctx = client.app.state.ctx  # type: ignore[attr-defined]
        parsed = StudySpec.model_validate(small_spec("zoned"))
        asked = opt.ask(opt.load_study(ctx.storage, parsed), parsed).number
        expiry = LeaseService(ctx).expiry
        expiry.fail_orphans()  # an hour's grace: the trial asked a moment ago is no orphan yet
        assert opt.load_study(ctx.storage, parsed).trials[asked].state.name == "RUNNING", local_zone
        expiry.settings = settings.model_copy(update={"orphan_grace_s": 0.0})
        expiry.fail_orphans()  # no grace: it is one now
        assert opt.load_study(ctx.storage, parsed).trials[asked].state.name == "FAIL", local_zone
