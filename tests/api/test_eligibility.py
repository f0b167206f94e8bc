"""A study no registered worker can take says so (study document, metric), naming the requirement none meets."""

from __future__ import annotations

from typing import Any

from tests.support.api_client import Api
from tests.support.specs import INVENTORY, small_spec


def eligibility(api: Api, name: str) -> dict[str, Any]:
    shown = api.get(f"/v1/studies/{name}", "user").json()
    assert shown["state"] == "running"
    return dict(shown["eligibility"])


def metric_lines(api: Api, study: str) -> list[str]:
    text = api.get("/metrics", "user").text
    return [line for line in text.splitlines() if line.startswith("spectune_study_") and f'study="{study}"' in line]


def lease(api: Api, worker: str, inventory: dict[str, Any]) -> Any:
    return api.post(f"/v1/workers/{worker}/lease", "worker", inventory)


def test_each_unmet_requirement_is_named(api: Api) -> None:
    api.post("/v1/studies", "user", small_spec("labels", placement={"gpu": "a100"}))
    first = eligibility(api, "labels")
    assert first["unmet"] == ["workers"] and "no worker has registered yet" in first["warning"]

    # A worker asks for work: it carries gpu=h200, so it gets none, and the study says why.
    assert lease(api, "w1", INVENTORY).status_code == 204
    e = eligibility(api, "labels")
    assert e["unmet"] == ["placement"] and e["eligible_workers"] == []
    assert "no worker carries the placement labels gpu=a100" in e["warning"]
    assert 'spectune_study_no_eligible_worker{requirement="placement",study="labels"} 1.0' in metric_lines(
        api, "labels"
    )
    assert 'spectune_study_eligible_workers{study="labels"} 0.0' in metric_lines(api, "labels")

    spec = small_spec("no-draft")
    spec["model"] = {"target": "moe-pcie", "draft": "not-registered"}
    api.post("/v1/studies", "user", spec)
    e = eligibility(api, "no-draft")
    assert e["unmet"] == ["models"] and "registry holds not-registered" in e["warning"]

    big = small_spec("tp8")
    big["model"] = {"target": "moe-pcie", "draft": "moe-pcie-eagle3", "tp_size": 8}
    api.post("/v1/studies", "user", big)
    e = eligibility(api, "tp8")
    assert e["unmet"] == ["gpus"] and "tp_size 8 needs 8 GPUs and no worker has more than 1" in e["warning"]

    # A study the worker can take: no warning, and the worker gets its lease (the first eligible study).
    api.post("/v1/studies", "user", small_spec("fits"))
    assert eligibility(api, "fits") == {
        "eligible_workers": ["w1"],
        "quarantined_workers": [],
        "unmet": [],
        "warning": None,
    }
    got = lease(api, "w1", INVENTORY)
    assert got.status_code == 200 and got.json()["study"] == "fits"
    assert not [line for line in metric_lines(api, "fits") if "no_eligible" in line]
    # A worker with 8 GPUs would take the tp8 study: the warning follows the fleet at once.
    eight = INVENTORY | {"gpus": [{"index": i, "name": "NVIDIA H200", "memory_mib": 143771} for i in range(8)]}
    assert lease(api, "w8", eight).status_code == 200
    assert eligibility(api, "tp8")["warning"] is None


def test_every_capable_worker_quarantined(api: Api) -> None:
    api.post("/v1/studies", "user", small_spec("held"))
    crash = {"outcome": "failed", "failure": {"kind": "crash", "message": "segfault in the engine"}}
    for _ in range(3):  # SPECTUNE_QUARANTINE_AFTER
        got = lease(api, "w1", INVENTORY)
        assert got.status_code == 200
        assert api.post(f"/v1/leases/{got.json()['lease_id']}/complete", "worker", crash).status_code == 200
    e = eligibility(api, "held")
    assert e["unmet"] == ["quarantine"] and e["quarantined_workers"] == ["w1"]
    assert "every worker that could take this study is quarantined (w1: 3 host failures" in e["warning"]
    assert 'spectune_study_no_eligible_worker{requirement="quarantine",study="held"} 1.0' in metric_lines(api, "held")
    assert api.post("/v1/workers/w1/release", "admin").status_code == 204
    assert eligibility(api, "held")["warning"] is None
    # Not running any more: nothing to warn about.
    api.post("/v1/studies/held/stop", "user")
    assert api.get("/v1/studies/held", "user").json()["eligibility"] is None
