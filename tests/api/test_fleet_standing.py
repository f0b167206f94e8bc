"""What the fleet decided about a worker, as the API says it (issue 33 item 6 and "Smaller"): the
standing header of every lease answer, and `GET /v1/workers`, where a refusal of a finished study
no longer stands."""

from __future__ import annotations

import json
from typing import Any

from spectune_protocol import STANDING_HEADER, WorkerStanding
from tests.support.api_client import Api
from tests.support.search import lease, ok, sim_levels
from tests.support.specs import INVENTORY, small_spec

REFUSED = {"outcome": "failed", "failure": {"kind": "refused", "message": "model moe-pcie not in\nthis registry"}}


def _standing(api: Api, worker: str) -> tuple[int, WorkerStanding]:
    r = api.post(f"/v1/workers/{worker}/lease", "fleet", INVENTORY)  # each host its own token
    assert r.status_code in (200, 204), r.text
    return r.status_code, WorkerStanding.model_validate(json.loads(r.headers[STANDING_HEADER]))


def _refusals(api: Api, worker: str) -> list[dict[str, Any]]:
    workers = {w["id"]: w for w in api.get("/v1/workers", "user").json()}
    return list(workers[worker]["refusals"])


def test_a_refusal_stands_while_its_study_is_open_and_ends_with_it(api: Api) -> None:
    spec = small_spec("short", budget={"max_trials": 1}, confirmation={"top": 0})
    assert api.post("/v1/studies", "user", spec).status_code == 201
    got = lease(api, "w1")
    assert got is not None and got["study"] == "short"
    assert api.post(f"/v1/leases/{got['lease_id']}/complete", "fleet", REFUSED).status_code == 200
    # Told to the worker with its next answer (a 204: nothing else is offered), one line each.
    status, standing = _standing(api, "w1")
    assert status == 204 and standing.quarantined is None
    assert [(r.study, r.reason) for r in standing.refused] == [("short", "model moe-pcie not in this registry")]
    assert [r["study"] for r in _refusals(api, "w1")] == ["short"]

    for _ in range(6):  # w2: its baseline, the one trial; then the study is finished
        got = lease(api, "w2")
        if got is None:
            break
        config = None if got["kind"] == "baseline" else got["config"]
        body = ok(sim_levels("moe-pcie", config, got["workload"]["concurrency"]))
        assert api.post(f"/v1/leases/{got['lease_id']}/complete", "fleet", body).status_code == 200
    assert api.get("/v1/studies/short", "user").json()["state"] == "finished"
    # A refusal of a finished study decides nothing: neither the fleet nor the worker lists it.
    assert _refusals(api, "w1") == []
    assert _standing(api, "w1")[1] == WorkerStanding()
    # The study keeps its own record of who refused it.
    assert [r["worker_id"] for r in api.get("/v1/studies/short", "user").json()["refused_by"]] == ["w1"]
