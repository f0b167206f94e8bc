"""Documents built from records (issue 32 item 4): `create` answers with what it just stored, not
by reading the study back through `show`, and says what GET says."""

from __future__ import annotations

import pytest

from api.services.studies import StudyService
from tests.api.test_rest_flow import lease, ok_metrics
from tests.support.api_client import Api
from tests.support.specs import small_spec


def test_the_created_study_is_the_document_get_shows(api: Api) -> None:
    # Another study of the same server measured a baseline: the new one shows it (and its noise).
    assert api.post("/v1/studies", "user", small_spec("first")).status_code == 201
    base = lease(api).json()
    assert base["kind"] == "baseline"
    assert api.post(f"/v1/leases/{base['lease_id']}/complete", "worker", ok_metrics(90.0)).status_code == 200
    r = api.post("/v1/studies", "user", small_spec("second"))
    assert r.status_code == 201, r.text
    created = r.json()
    assert [b["worker_id"] for b in created["baselines"]] == ["w1"]
    assert created["trials"]["WAITING"] >= 1  # its warm start, enqueued
    assert created == api.get("/v1/studies/second", "user").json()


def test_create_does_not_read_the_study_back_through_show(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(self: StudyService, name: str) -> object:
        raise AssertionError(f"show({name!r}) called")

    monkeypatch.setattr(StudyService, "show", refused)
    assert api.post("/v1/studies", "user", small_spec("direct")).status_code == 201
